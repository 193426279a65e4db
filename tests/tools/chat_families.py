"""The chat templates of the model families zoffload trains, as their model repositories ship them
(tokenizer_config.json "chat_template" or chat_template.jinja), the tokens their tokenizers have, and
conversations with their renderings written out by hand: what tokenize_cli_test.py checks
tools/tokenize_data.py --format chat against (issue 44)."""

# Qwen/Qwen3-8B: the last reply after the last user message opens with a <think> block, empty
# when the message has none; earlier replies are written without it.
QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""
# allenai/OLMo-2-1124-7B-Instruct (Tulu 3): plain-text role markers, eos after each reply, BOS (= eos) first.
OLMO2 = (r"{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}{{ '<|system|>\n' + "
         r"message['content'] + '\n' }}{% elif message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + "
         r"'\n' }}{% elif message['role'] == 'assistant' %}{% if not loop.last %}{{ '<|assistant|>\n'  + "
         r"message['content'] + eos_token + '\n' }}{% else %}{{ '<|assistant|>\n'  + message['content'] + eos_token }}"
         r"{% endif %}{% endif %}{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
         r"{% endfor %}")
# google/gemma-3-4b-it (and gemma-3-1b-it): the system prompt opens the first user turn; "model" turns.
GEMMA3 = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
# microsoft/Phi-3-mini-4k-instruct: eos after the last message where no generation prompt follows.
PHI3 = (r"{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
        r"'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
        r"{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
        r"{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")
# microsoft/Phi-4-mini-instruct: no line breaks, <|system|> (with tools), eos last as Phi-3.
PHI4_MINI = (r"{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and "
             r"message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + "
             r"message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + "
             r"message['content'] + '<|end|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
             r"{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}")
# name: (config.json's model_type, template, the tokenizer's special tokens, eos, bos, added tokens)
FAMILIES = {
    "qwen3": ("qwen3", QWEN3, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>", None, ["<think>", "</think>"]),
    "olmo2": ("olmo2", OLMO2, ["<|endoftext|>", "<|pad|>"], "<|endoftext|>", "<|endoftext|>", []),
    "gemma3": ("gemma3_text", GEMMA3, ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"], "<eos>",
               "<bos>", []),
    "phi3": ("phi3", PHI3, ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|end|>", "<|system|>", "<|user|>"],
             "<|endoftext|>", "<s>", []),
    "phi4-mini": ("phi3", PHI4_MINI, ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|system|>", "<|user|>", "<|tool|>",
                                      "<|/tool|>"], "<|endoftext|>", "<|endoftext|>", []),
}
# gemma-3-4b-it's config.json as it ships: its text_config leaves vocab_size at Gemma3TextConfig's default.
GEMMA3_VOCAB_SIZE = 262208
GEMMA3_4B_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "mm_tokens_per_image": 256, "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False}}
SYS_MULTI = [{"role": "system", "content": "you are terse"}, {"role": "user", "content": "hello there"},
             {"role": "assistant", "content": "hello world"}, {"role": "user", "content": "and the dog?"},
             {"role": "assistant", "content": "the lazy dog, today"}]
ENDS_WITH_USER = [{"role": "user", "content": "the quick brown fox?"}, {"role": "assistant", "content": "jumps over\n"},
                  {"role": "user", "content": "no reply to this one"}]
REASONING = [{"role": "system", "content": "you are terse"}, {"role": "user", "content": "hello there"},
             {"role": "assistant", "content": "<think>\nthe user greets\n</think>\n\nhello world"},
             {"role": "user", "content": "and the dog?"},
             {"role": "assistant", "content": "<think>\ndogs are lazy\n</think>\n\nthe lazy dog"}]
# Each family's conversations and their renderings, written out by hand from the templates above as
# (text, labelled) pieces: labelled are each reply and what closes its turn.
FAMILY_CHATS = {
    "qwen3": [
        (SYS_MULTI, [("<|im_start|>system\nyou are terse<|im_end|>\n<|im_start|>user\nhello there<|im_end|>\n"
                      "<|im_start|>assistant\n", 0), ("hello world<|im_end|>\n", 1),
                     ("<|im_start|>user\nand the dog?<|im_end|>\n<|im_start|>assistant\n", 0),
                     ("<think>\n\n</think>\n\nthe lazy dog, today<|im_end|>\n", 1)]),
        (ENDS_WITH_USER, [("<|im_start|>user\nthe quick brown fox?<|im_end|>\n<|im_start|>assistant\n", 0),
                          ("jumps over\n<|im_end|>\n", 1), ("<|im_start|>user\nno reply to this one<|im_end|>\n", 0)]),
        (REASONING, [("<|im_start|>system\nyou are terse<|im_end|>\n<|im_start|>user\nhello there<|im_end|>\n"
                      "<|im_start|>assistant\n", 0), ("hello world<|im_end|>\n", 1),
                     ("<|im_start|>user\nand the dog?<|im_end|>\n<|im_start|>assistant\n", 0),
                     ("<think>\ndogs are lazy\n</think>\n\nthe lazy dog<|im_end|>\n", 1)]),
    ],
    "olmo2": [
        (SYS_MULTI, [("<|endoftext|><|system|>\nyou are terse\n<|user|>\nhello there\n<|assistant|>\n", 0),
                     ("hello world<|endoftext|>", 1), ("\n<|user|>\nand the dog?\n<|assistant|>\n", 0),
                     ("the lazy dog, today<|endoftext|>", 1)]),
        (ENDS_WITH_USER, [("<|endoftext|><|user|>\nthe quick brown fox?\n<|assistant|>\n", 0),
                          ("jumps over\n<|endoftext|>", 1), ("\n<|user|>\nno reply to this one\n", 0)]),
    ],
    "gemma3": [
        (SYS_MULTI, [("<bos><start_of_turn>user\nyou are terse\n\nhello there<end_of_turn>\n<start_of_turn>model\n", 0),
                     ("hello world<end_of_turn>\n", 1),
                     ("<start_of_turn>user\nand the dog?<end_of_turn>\n<start_of_turn>model\n", 0),
                     ("the lazy dog, today<end_of_turn>\n", 1)]),
        (ENDS_WITH_USER, [("<bos><start_of_turn>user\nthe quick brown fox?<end_of_turn>\n<start_of_turn>model\n", 0),
                          ("jumps over<end_of_turn>\n", 1),
                          ("<start_of_turn>user\nno reply to this one<end_of_turn>\n", 0)]),
    ],
    "phi3": [
        (SYS_MULTI, [("<|system|>\nyou are terse<|end|>\n<|user|>\nhello there<|end|>\n<|assistant|>\n", 0),
                     ("hello world<|end|>\n", 1), ("<|user|>\nand the dog?<|end|>\n<|assistant|>\n", 0),
                     ("the lazy dog, today<|end|>\n<|endoftext|>", 1)]),
        (ENDS_WITH_USER, [("<|user|>\nthe quick brown fox?<|end|>\n<|assistant|>\n", 0), ("jumps over\n<|end|>\n", 1),
                          ("<|user|>\nno reply to this one<|end|>\n<|endoftext|>", 0)]),
    ],
    "phi4-mini": [
        (SYS_MULTI, [("<|system|>you are terse<|end|><|user|>hello there<|end|><|assistant|>", 0),
                     ("hello world<|end|>", 1), ("<|user|>and the dog?<|end|><|assistant|>", 0),
                     ("the lazy dog, today<|end|><|endoftext|>", 1)]),
        (ENDS_WITH_USER, [("<|user|>the quick brown fox?<|end|><|assistant|>", 0), ("jumps over\n<|end|>", 1),
                          ("<|user|>no reply to this one<|end|><|endoftext|>", 0)]),
    ],
}
# Two replies after the last user message: Qwen3 writes the first one with a <think> block when it
# is the last message and without one when another follows, so the conversation up to the second
# with the generation prompt is not a prefix of the conversation with it.
QWEN3_UNMASKABLE = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hello world"},
                    {"role": "assistant", "content": "the lazy dog"}]
