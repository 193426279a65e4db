#!/usr/bin/env python3
"""tools/tokenize_data.py as a user runs it, with a byte-level BPE tokenizer trained here (no
network): text paragraphs, lines and whole files, JSONL with a named field, and a vocabulary over
65536 become llm.c .bin files whose header is right and whose tokens are the tokenizer's own
encoding of each document followed by the end-of-text token, decoding back to the input; chat JSONL
keeps labels on exactly the assistant replies, computed here piece by piece from the template's
parts. So it does with the chat templates of Qwen3 (which drops the <think> block of earlier
replies), OLMo 2, Gemma 3, Phi-3 and Phi-4-mini (which end the conversation with eos), whose
renderings are written out here by hand, with apply_chat_template's input_ids; gemma-3-4b-it's
config.json, which has no vocab_size, gets transformers' default. Both outputs train with
`zoffload train` on a LLaMA written by transformers. A missing or tokenizer-less model directory,
one with tokenizer_config.json but no vocabulary file, one whose vocabulary files are empty
(transformers loads a tokenizer of special tokens only), a document the tokenizer encodes to
special tokens only, an id past vocab_size, a config.json with neither a vocab_size nor a
model_type transformers knows, a chat file for a tokenizer without a chat template
or with one that is not prefix-stable (a made-up one; Qwen3's where two replies follow the last
user message), a malformed JSONL line, a line nested 100,000 deep, a lone UTF-16 surrogate in JSONL
or chat text (escaped or as bytes; an escaped pair is its character), a missing field and bad usage
each fail with one line and exit 2; a failed write, a transformers that breaks under the tool's
block on importing torch and one that cannot be imported fail with one line and exit 1. None
leaves an output or a temporary file, and an existing --out is untouched. With
ZO_TOKENIZE_ALLOW_TORCH=1 (the block off) the tool writes the same tokens.
Usage: tokenize_cli_test.py TOOLS/tokenize_data.py ZOFFLOAD"""
import json
import os
import struct
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

from cli_checks import expect, report_and_exit
from chat_families import (FAMILIES, FAMILY_CHATS, GEMMA3_4B_CONFIG, GEMMA3_VOCAB_SIZE, QWEN3_UNMASKABLE,
                          SYS_MULTI)

tool, zoffload = sys.argv[1], sys.argv[2]

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_VERBOSITY"] = "error"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
import warnings  # noqa: E402

warnings.filterwarnings("ignore")
try:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
except ImportError as e:
    print("SKIP: transformers, tokenizers or torch is not installed in %s (%s); tools/requirements.txt pins them" %
          (sys.executable, e))
    sys.exit(77)

EOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHATML = ("{% for m in messages %}" + IM_START + "{{ m['role'] }}\n{{ m['content'] }}" + IM_END + "\n{% endfor %}"
          "{% if add_generation_prompt %}" + IM_START + "assistant\n{% endif %}")
# Renders every turn but the last with a marker: not prefix-stable.
UNSTABLE = ("{% for m in messages %}{% if not loop.last %}[earlier] {% endif %}" + IM_START +
            "{{ m['role'] }}\n{{ m['content'] }}" + IM_END + "\n{% endfor %}"
            "{% if add_generation_prompt %}" + IM_START + "assistant\n{% endif %}")
TRAIN_LINES = [
    "the quick brown fox jumps over the lazy dog",
    "a model learns what the data shows it, one token at a time",
    "offload the optimizer states to nvme and keep the parameters in pinned memory",
    "hello world, hello there, how are you today?",
]
CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}}


def make_tokenizer(specials=(EOS, IM_START, IM_END), eos=EOS, bos=None, added=()):
    """A byte-level BPE (any text round-trips) trained on TRAIN_LINES, with these special tokens
    (ChatML's unless given) and added ordinary tokens."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(TRAIN_LINES * 4, trainers.BpeTrainer(
        vocab_size=320, special_tokens=list(specials), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=eos, bos_token=bos)
    tok.add_tokens(list(added))
    return tok


def write_model_dir(d, tok, template, vocab_size=None, weights=False):
    """tok's files with this chat template and config.json (vocab_size: the tokenizer's unless
    given); with weights, a random LLaMA saved by transformers."""
    tok.chat_template = template
    tok.save_pretrained(d)
    config = LlamaConfig(vocab_size=vocab_size or len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
                         rope_theta=10000.0, eos_token_id=tok.eos_token_id, bos_token_id=None, pad_token_id=None)
    if weights:
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(d)
    else:
        config.save_pretrained(d)


def run_tool(args, env=None, prefix=()):
    """The tool with these arguments, these variables added to the environment, and the command
    line behind prefix (a wrapper that execs it)."""
    return subprocess.run([*prefix, sys.executable, tool, *args], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **(env or {})))


def make_wordlevel():
    """A whole-word tokenizer of TRAIN_LINES' words: anything else is its [UNK] (a special token)."""
    from tokenizers.models import WordLevel
    words = sorted({w for line in TRAIN_LINES for w in line.replace(",", " ").replace("?", " ").split()})
    wl = Tokenizer(WordLevel({w: i for i, w in enumerate(["[UNK]", EOS] + words)}, unk_token="[UNK]"))
    wl.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=wl, unk_token="[UNK]", eos_token=EOS)


def read_bin(path):
    """(header ints, tokens) of an llm.c file, read with the standard library."""
    blob = open(path, "rb").read()
    header = struct.unpack("<256i", blob[:1024])
    width = {1: 2, 2: 4}.get(header[1])
    if width is None:
        return header, None
    body = blob[1024:]
    if len(body) != header[2] * width:
        return header, None
    return header, list(struct.unpack("<%d%s" % (header[2], "H" if width == 2 else "I"), body))


def write(path, text):
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)


with tempfile.TemporaryDirectory(prefix="zo-tokenize-cli-", dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
    def p(*parts):
        return os.path.join(tmp, *parts)

    model = p("model")
    tok = make_tokenizer()
    eos = tok.eos_token_id
    vocab = len(tok)
    for name, template, vs in (("nochat", None, None), ("unstable", UNSTABLE, None), ("wide", CHATML, 70000),
                               ("small", CHATML, 259)):
        write_model_dir(p(name), tok, template, vs)
    write_model_dir(model, tok, CHATML, weights=True)
    os.makedirs(p("notok"))
    write(p("notok", "config.json"), json.dumps({"model_type": "llama", "vocab_size": 300}))
    # tokenizer_config.json without a vocabulary file: transformers would load an empty LlamaTokenizer.
    os.makedirs(p("configonly"))
    write(p("configonly", "config.json"), json.dumps({"model_type": "llama", "vocab_size": 300}))
    write(p("configonly", "tokenizer_config.json"), json.dumps({"tokenizer_class": "LlamaTokenizer", "eos_token": "</s>"}))
    # vocab.json and merges.txt, which LlamaTokenizer does not read: it loads empty, 3 special tokens.
    os.makedirs(p("emptyvocab"))
    for f in ("config.json", "tokenizer_config.json"):
        write(p("emptyvocab", f), open(p("configonly", f)).read())
    write(p("emptyvocab", "vocab.json"), "{}")
    write(p("emptyvocab", "merges.txt"), "#version: 0.2\n")
    for family, (model_type, template, specials, f_eos, f_bos, added) in FAMILIES.items():
        ftok = make_tokenizer(specials, f_eos, f_bos, added)
        ftok.chat_template = template
        ftok.save_pretrained(p(family))
        write(p(family, "config.json"), json.dumps({"model_type": model_type, "vocab_size": len(ftok)}))
        write(p("chat-%s.jsonl" % family), "".join(json.dumps({"messages": c}) + "\n" for c, _ in FAMILY_CHATS[family]))
        if family == "gemma3":
            ftok.save_pretrained(p("gemma3-4b"))
            write(p("gemma3-4b", "config.json"), json.dumps(GEMMA3_4B_CONFIG))
    write(p("qwen3-unmaskable.jsonl"), "".join(json.dumps({"messages": c}) + "\n" for c in (SYS_MULTI, QWEN3_UNMASKABLE)))
    # No vocab_size, and a model_type transformers does not know, so no default for it either.
    tok.save_pretrained(p("novocab"))
    write(p("novocab", "config.json"), json.dumps({"model_type": "no_such_model_zo", "hidden_size": 64}))
    wordlevel = make_wordlevel()
    wordlevel.save_pretrained(p("wordlevel"))
    write(p("wordlevel", "config.json"), json.dumps({"model_type": "llama", "vocab_size": len(wordlevel)}))
    # Python packages that stand in for a transformers that breaks: one imports torch (blocked by the
    # tool), one a module that is not there.
    for d, body in (("torchy", "import torch\n"), ("broken", "import no_such_module_zo\n")):
        os.makedirs(p(d, "transformers"))
        write(p(d, "transformers", "__init__.py"), body)

    def enc(text):
        return tok(text)["input_ids"]

    # ---- inputs ----
    paragraphs = ["the quick brown fox\njumps over the lazy dog.", "  héllo wörld – naïve ✓, 42 tokens\r\nsecond line",
                  "a model learns what the data shows it"]
    write(p("corpus.txt"), "\n" + paragraphs[0] + "\n\n\n" + paragraphs[1] + "\r\n \n" + paragraphs[2] + "\n")
    # Enough text for a few 16-token rows of micro-batch 2.
    long_text = "\n\n".join(TRAIN_LINES * 8) + "\n"
    write(p("long.txt"), long_text)
    long_docs = TRAIN_LINES * 8
    write(p("one.txt"), "first file\n\nstill the first file\n")
    write(p("two.txt"), "second file")
    jsonl_rows = [{"id": 1, "body": "hello world"}, {"id": 2, "body": ""}, {"id": 3, "body": "how are you today?\nfine"}]
    write(p("docs.jsonl"), json.dumps(jsonl_rows[0]) + "\n\n" + "\n".join(json.dumps(r) for r in jsonl_rows[1:]) + "\n")
    conversations = [
        [{"role": "system", "content": "you are terse"}, {"role": "user", "content": "hello there"},
         {"role": "assistant", "content": "hello world"}],
        [{"role": "user", "content": "the quick brown fox?"}, {"role": "assistant", "content": "jumps over"},
         {"role": "user", "content": "and the dog?"}, {"role": "assistant", "content": "the lazy dog, today"}],
        [{"role": "user", "content": "no reply to this one"}],
    ]
    chat_lines = [json.dumps({"messages": c}) for c in conversations * 4]
    write(p("chat.jsonl"), "\n".join(chat_lines) + "\n")
    # A malformed line after more than one batch of good ones: the failure comes after writing began.
    write(p("bad.jsonl"), "".join(json.dumps({"text": "hello world %d" % i}) + "\n" for i in range(5000)) +
          '{"text": "cut off\n' + json.dumps({"text": "after"}) + "\n")
    write(p("nofield.jsonl"), json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "no text here"}) + "\n")
    # Issue 40: a lone UTF-16 surrogate, as a JSON escape or as the bytes json.loads decodes with
    # surrogatepass, made the tokenizer fail with a traceback. An escaped pair is one character.
    write(p("surrogate.jsonl"), json.dumps({"text": "fine"}) + "\n" + '{"text": "\\ud800x"}\n')
    with open(p("surrogate_bytes.jsonl"), "wb") as fh:
        fh.write(b'{"text": "a\xed\xa0\x80b"}\n')
    write(p("chat_surrogate.jsonl"), "\n".join(chat_lines[:2]) + "\n" + '{"messages": [{"role": "user", "content": "hi"}, '
          '{"role": "assistant", "content": "\\udc00 there"}]}\n')
    pair_texts = ["hello \U0001F600 world", "\u00e9t\u00e9"]
    write(p("pair.jsonl"), "".join(json.dumps({"text": t}) + "\n" for t in pair_texts))  # ensure_ascii: \ud83d\ude00
    write(p("deep.jsonl"), '{"text": ' + "[" * 100000 + "]" * 100000 + "}\n")
    small_lines = ["a", "b c", "hello world", "z"]
    write(p("small.jsonl"), "".join(json.dumps({"text": t}) + "\n" for t in small_lines))
    os.makedirs(p("existing"))
    keep = b"an earlier output, left as it was"
    for f in ("keep.bin", "keep.jsonl"):
        with open(p("existing", f), "wb") as fh:
            fh.write(keep)
    write(p("afile"), "a regular file where a directory is needed")
    write(p("unknown.txt"), "the quick brown fox\n\nxyzzy plugh\n")
    write(p("special.txt"), "hello world\n" + EOS + "\n")

    # ---- every run of the tool, in parallel (each imports transformers: a few seconds) ----
    os.makedirs(p("out"))
    runs = {
        "text": ["--model", model, "--input", p("corpus.txt"), "--out", p("out", "text.bin"), "--json"],
        "allow torch": (["--model", model, "--input", p("corpus.txt"), "--out", p("out", "torch.bin"), "-q"],
                        {"ZO_TOKENIZE_ALLOW_TORCH": "1"}),
        "special only": ["--model", model, "--input", p("special.txt"), "--split", "line", "--out", p("out", "special.bin"),
                         "-q"],
        "long": ["--model", model, "--input", p("long.txt"), "--out", p("out", "sub", "long.bin"), "-q"],
        "line": ["--model", model, "--input", p("corpus.txt"), "--split", "line", "--out", p("out", "line.bin"), "-q"],
        "file": ["--model", model, "--input", p("one.txt"), p("two.txt"), "--split", "file", "--no-eos",
                 "--out", p("out", "file.jsonl"), "-q"],
        "jsonl": ["--model", model, "--input", p("docs.jsonl"), "--field", "body", "--out", p("out", "docs.jsonl")],
        "wide": ["--model", p("wide"), "--input", p("corpus.txt"), "--out", p("out", "wide.bin"), "-q"],
        "chat": ["--model", model, "--input", p("chat.jsonl"), "--format", "chat", "--out", p("out", "chat.jsonl"),
                 "--json"],
        "pair": ["--model", model, "--input", p("pair.jsonl"), "--out", p("out", "pair.jsonl"), "-q"],
        "gemma3-4b": ["--model", p("gemma3-4b"), "--input", p("chat-gemma3.jsonl"), "--format", "chat",
                      "--out", p("out", "chat-gemma3-4b.jsonl"), "--json"],
    }
    for family in FAMILIES:
        runs["chat " + family] = ["--model", p(family), "--input", p("chat-%s.jsonl" % family), "--format", "chat",
                                  "--out", p("out", "chat-%s.jsonl" % family), "--json"]
    # (args, exit code, what the one line must contain); args may be (args, env, prefix) as run_tool takes
    failures = {
        "config only": (["--model", p("configonly"), "--input", p("corpus.txt"), "--out", p("existing", "keep.bin")], 2,
                        "no tokenizer vocabulary"),
        "empty vocabulary": (["--model", p("emptyvocab"), "--input", p("corpus.txt"), "--out", p("existing", "keep.bin")],
                             2, "has 3 token(s), 3 of them special"),
        "special tokens only": (["--model", p("wordlevel"), "--input", p("unknown.txt"), "--out", p("existing", "keep.bin")],
                                2, "unknown.txt:3: the text encodes to special tokens only"),
        "torch block": ((["--model", model, "--input", p("corpus.txt"), "--out", p("existing", "keep.bin")],
                         {"PYTHONPATH": p("torchy")}), 1, "ZO_TOKENIZE_ALLOW_TORCH=1"),
        "no transformers": ((["--model", model, "--input", p("corpus.txt"), "--out", p("existing", "keep.bin")],
                             {"PYTHONPATH": p("broken")}), 1, "-m pip install -r "),
        # No file may grow past 0 bytes: the first write of the output fails (EFBIG; Python ignores SIGXFSZ).
        "write fails": ((["--model", model, "--input", p("corpus.txt"), "--out", p("existing", "keep.bin")], None,
                         ("sh", "-c", 'ulimit -f 0 && exec "$0" "$@"')), 1, "cannot write"),
        "no model dir": (["--model", p("nope"), "--input", p("corpus.txt"), "--out", p("existing", "keep.bin")], 2,
                         p("nope")),
        "no tokenizer": (["--model", p("notok"), "--input", p("corpus.txt"), "--out", p("existing", "keep.bin")], 2,
                         "no tokenizer vocabulary"),
        "vocab": (["--model", p("small"), "--input", p("small.jsonl"), "--out", p("existing", "keep.bin")], 2, None),
        "no chat template": (["--model", p("nochat"), "--input", p("chat.jsonl"), "--format", "chat",
                              "--out", p("existing", "keep.jsonl")], 2, "no chat template"),
        "not prefix-stable": (["--model", p("unstable"), "--input", p("chat.jsonl"), "--format", "chat",
                               "--out", p("existing", "keep.jsonl")], 2, "chat.jsonl:1: the chat template is not prefix-stable"),
        "qwen3 unmaskable": (["--model", p("qwen3"), "--input", p("qwen3-unmaskable.jsonl"), "--format", "chat",
                              "--out", p("existing", "keep.jsonl")], 2,
                             "qwen3-unmaskable.jsonl:2: the chat template is not prefix-stable at message 2 (assistant): "
                             "rendering the conversation up to it with the generation prompt is not a prefix of "
                             "rendering it with the reply"),
        "no vocab_size": (["--model", p("novocab"), "--input", p("corpus.txt"), "--out", p("existing", "keep.bin")], 2,
                          'config.json: no "vocab_size" (at its top or in "text_config"), and transformers cannot load '
                          'the config for its default: The checkpoint you are trying to load has model type '
                          '`no_such_model_zo`'),
        "malformed line": (["--model", model, "--input", p("bad.jsonl"), "--out", p("existing", "keep.bin")], 2,
                           "bad.jsonl:5001: not valid JSON"),
        "lone surrogate": (["--model", model, "--input", p("surrogate.jsonl"), "--out", p("existing", "keep.bin")], 2,
                           'surrogate.jsonl:2: "text" holds a lone UTF-16 surrogate (\\ud800 at character 1)'),
        "surrogate bytes": (["--model", model, "--input", p("surrogate_bytes.jsonl"), "--out", p("existing", "keep.jsonl")],
                            2, 'surrogate_bytes.jsonl:1: "text" holds a lone UTF-16 surrogate (\\ud800 at character 2)'),
        "chat surrogate": (["--model", model, "--input", p("chat_surrogate.jsonl"), "--format", "chat",
                            "--out", p("existing", "keep.jsonl")], 2,
                           "chat_surrogate.jsonl:3: messages[1].content holds a lone UTF-16 surrogate (\\udc00"),
        "deep nesting": (["--model", model, "--input", p("deep.jsonl"), "--out", p("existing", "keep.bin")], 2,
                         "deep.jsonl:1: JSON nested too deeply to read"),
        "missing field": (["--model", model, "--input", p("nofield.jsonl"), "--out", p("existing", "keep.bin")], 2,
                          'nofield.jsonl:2: no "text" field'),
        "chat to bin": (["--model", model, "--input", p("chat.jsonl"), "--format", "chat", "--out", p("existing", "keep.bin")],
                        2, ".jsonl"),
        "bad extension": (["--model", model, "--input", p("corpus.txt"), "--out", p("existing", "x.npy")], 2, "x.npy"),
        "no input": (["--model", model, "--input", p("nope.txt"), "--out", p("existing", "keep.bin")], 2, "nope.txt"),
        "no --out": (["--model", model, "--input", p("corpus.txt")], 2, "--out"),
        "unwritable": (["--model", model, "--input", p("corpus.txt"), "--out", p("afile", "x.bin")], 1, "afile"),
    }
    jobs = {k: a for k, a in runs.items()}
    jobs.update({k: v[0] for k, v in failures.items()})
    jobs["help"] = ["--help"]
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        done = dict(zip(jobs, pool.map(lambda a: run_tool(*a) if isinstance(a, tuple) else run_tool(a), jobs.values())))

    def ok(key):
        r = done[key]
        return expect(r.returncode == 0, "%s: exit 0, got %d: %s" % (key, r.returncode, r.stderr.strip()))

    # Text paragraphs: blank (or whitespace-only) lines separate documents, line breaks inside stay.
    if ok("text"):
        header, tokens = read_bin(p("out", "text.bin"))
        expect(header[:2] == (20240520, 1) and not any(header[3:]), "llm.c header: magic, version 1, zeros: %s" % (header[:4],))
        expect(tokens is not None, "the header's count (%d) matches the file size" % header[2])
        want = [t for d in paragraphs for t in enc(d) + [eos]]
        expect(tokens == want, "text: the tokenizer's encoding of each paragraph, then eos: %s vs %s" % (tokens, want))
        expect(tokens is not None and tok.decode(tokens) == "".join(d + EOS for d in paragraphs),
               "text: decodes back to the paragraphs with eos between: %r" % (tokens and tok.decode(tokens)))
        s = json.loads(done["text"].stdout)
        expect(s["documents"] == 3 and s["tokens"] == len(want) and s["llmc_version"] == 1 and s["vocab_size"] == vocab
               and s["eos_token_id"] == eos, "--json summary: %s" % s)
    if ok("line"):
        _, tokens = read_bin(p("out", "line.bin"))
        lines = [l for d in paragraphs for l in d.replace("\r\n", "\n").split("\n")]
        expect(tokens == [t for l in lines for t in enc(l) + [eos]], "--split line: one document per non-blank line")
    if ok("file"):
        rows = [json.loads(l) for l in open(p("out", "file.jsonl"))]
        expect([r["input_ids"] for r in rows] == [enc("first file\n\nstill the first file\n"), enc("second file")],
               "--split file, two inputs, --no-eos: each file whole, nothing appended: %s" % rows)
        expect(all("labels" not in r for r in rows), "text to .jsonl: no labels")
    if ok("long"):
        expect(done["long"].stdout == "" and done["long"].stderr == "",
               "-q prints nothing: %r %r" % (done["long"].stdout, done["long"].stderr))
        _, tokens = read_bin(p("out", "sub", "long.bin"))
        expect(tokens == [t for d in long_docs for t in enc(d) + [eos]], "--out in a new directory: written")
    if ok("jsonl"):
        rows = [json.loads(l) for l in open(p("out", "docs.jsonl"))]
        want = [enc(r["body"]) + [eos] for r in jsonl_rows if r["body"]]
        expect([r["input_ids"] for r in rows] == want, "jsonl --field body: one line per non-empty text, eos last: %s" % rows)
        expect(done["jsonl"].stdout.startswith("wrote ") and "2 documents" in done["jsonl"].stdout,
               "a summary line on stdout: %r" % done["jsonl"].stdout)
    if ok("wide"):
        header, tokens = read_bin(p("out", "wide.bin"))
        expect(header[:3] == (20240520, 2, len(tokens or [])), "vocab_size 70000: version 2 (uint32): %s" % (header[:3],))
        expect(tokens == [t for d in paragraphs for t in enc(d) + [eos]], "version 2 tokens read back")
    if ok("allow torch"):
        expect(open(p("out", "torch.bin"), "rb").read() == open(p("out", "text.bin"), "rb").read(),
               "ZO_TOKENIZE_ALLOW_TORCH=1: the same tokens as with the block on")
    if ok("special only"):
        _, tokens = read_bin(p("out", "special.bin"))
        expect(tokens == enc("hello world") + [eos, eos], "a document that is just %s is its token: %s" % (EOS, tokens))

    if ok("pair"):
        rows = [json.loads(l) for l in open(p("out", "pair.jsonl"))]
        expect([r["input_ids"] for r in rows] == [enc(t) + [eos] for t in pair_texts],
               "escaped surrogate pairs are the characters they spell: %s" % rows)

    # Chat: the expected rows built piece by piece from the template's parts, each encoded alone
    # (every part starts a pre-token here, so the pieces are the whole's tokens).
    if ok("chat"):
        rows = [json.loads(l) for l in open(p("out", "chat.jsonl"))]
        expect(len(rows) == len(chat_lines), "one line per conversation (%d)" % len(rows))
        for k, (row, conv) in enumerate(zip(rows, conversations * 4)):
            ids, labels = [], []
            for m in conv:
                head = tok.encode(IM_START + m["role"] + "\n", add_special_tokens=False)
                body = tok.encode(m["content"] + IM_END + "\n", add_special_tokens=False)
                ids += head + body
                labels += [-100] * len(head) + (body if m["role"] == "assistant" else [-100] * len(body))
            whole = tok.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"]
            if not (expect(row["input_ids"] == ids == whole, "chat %d: input_ids are the template's tokens" % k) and
                    expect(row["labels"] == labels, "chat %d: labels on exactly the assistant replies and their "
                           "<|im_end|>\\n:\n  got  %s\n  want %s" % (k, row["labels"], labels))):
                break
        s = json.loads(done["chat"].stdout)
        expect(s["conversations_without_reply"] == 4 and s["labelled_tokens"] == sum(
            sum(1 for l in r["labels"] if l != -100) for r in rows), "chat summary: %s" % s)

    # The families' templates (issue 44): input_ids are apply_chat_template's, and equal the expected
    # rendering's pieces encoded one by one (each piece starts a pre-token), whose labelled pieces
    # are exactly the labels.
    from transformers import AutoTokenizer
    for family in FAMILIES:
        key = "chat " + family
        if not ok(key):
            continue
        ftok = AutoTokenizer.from_pretrained(p(family))
        rows = [json.loads(l) for l in open(p("out", "chat-%s.jsonl" % family))]
        expect(len(rows) == len(FAMILY_CHATS[family]), "%s: one line per conversation: %d" % (key, len(rows)))
        for k, (row, (conv, pieces)) in enumerate(zip(rows, FAMILY_CHATS[family])):
            ids, labels = [], []
            for text, labelled in pieces:
                piece = ftok.encode(text, add_special_tokens=False)
                ids += piece
                labels += piece if labelled else [-100] * len(piece)
            whole = ftok.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"]
            rendered = ftok.apply_chat_template(conv, tokenize=False)
            expect(rendered == "".join(t for t, _ in pieces), "%s %d: the template renders as written out here:"
                   "\n  got  %r\n  want %r" % (key, k, rendered, "".join(t for t, _ in pieces)))
            expect(row["input_ids"] == whole == ids, "%s %d: input_ids are apply_chat_template's tokens:\n  got  %s\n"
                   "  template %s\n  pieces   %s" % (key, k, row["input_ids"], whole, ids))
            expect(row["labels"] == labels, "%s %d: labels on exactly the replies and what closes their turn %r, "
                   "got them on %r:\n  got  %s\n  want %s" % (key, k, [t for t, l in pieces if l], ftok.decode(
                       [t for t in row["labels"] if t != -100]), row["labels"], labels))
        s = json.loads(done[key].stdout)
        expect(s["vocab_size"] == len(ftok) and s["conversations_without_reply"] == 0,
               "%s: the summary names config.json's vocab_size %d: %s" % (key, len(ftok), s))
    if ok("gemma3-4b") and done["chat gemma3"].returncode == 0:
        s = json.loads(done["gemma3-4b"].stdout)
        expect(s["vocab_size"] == GEMMA3_VOCAB_SIZE, "gemma3 config.json without vocab_size: transformers' %d: %s"
               % (GEMMA3_VOCAB_SIZE, s))
        expect(open(p("out", "chat-gemma3-4b.jsonl")).read() == open(p("out", "chat-gemma3.jsonl")).read(),
               "gemma-3-4b-it's config.json: the same rows as gemma3_text's")

    # Failures: one line, the exit code, nothing written, an existing --out untouched.
    first_bad = next((i, t) for i, l in enumerate(small_lines) for t in enc(l) + [eos] if t >= 259)
    failures["vocab"] = failures["vocab"][:2] + ("small.jsonl:%d: token id %d" % (first_bad[0] + 1, first_bad[1]),)
    for key, (args, code, needle) in failures.items():
        r = done[key]
        lines = r.stderr.splitlines()
        expect(r.returncode == code, "%s: exit %d, got %d: %s" % (key, code, r.returncode, r.stderr.strip()))
        expect(len(lines) == 1 and lines[0].startswith("tokenize_data: error: ") and needle in lines[0],
               "%s: one line naming %r: %r" % (key, needle, r.stderr))
    expect("259" in done["vocab"].stderr, "vocab: names vocab_size: %s" % done["vocab"].stderr.strip())
    for f in ("keep.bin", "keep.jsonl"):
        expect(open(p("existing", f), "rb").read() == keep, "%s: an existing --out is left as it was" % f)
    expect(sorted(os.listdir(p("existing"))) == ["keep.bin", "keep.jsonl"],
           "no output and no temporary file left: %s" % os.listdir(p("existing")))
    expect(open(p("afile")).read() == "a regular file where a directory is needed", "the unwritable --out's parent is untouched")
    strays = [os.path.join(d, f) for d, _, fs in os.walk(tmp) for f in fs if f.endswith(".tmp")]
    expect(not strays, "no temporary file anywhere: %s" % strays)
    expect(done["help"].returncode == 0 and "--format" in done["help"].stdout and "vocab_size" in done["help"].stdout
           and "ZO_TOKENIZE_ALLOW_TORCH=1" in done["help"].stdout, "--help answers, naming ZO_TOKENIZE_ALLOW_TORCH")

    # zoffload trains on both outputs.
    write(p("config.json"), json.dumps(CONFIG))
    for key, data in (("long", p("out", "sub", "long.bin")), ("chat", p("out", "chat.jsonl"))):
        if done[key].returncode != 0:
            continue
        r = subprocess.run([zoffload, "train", "--config", p("config.json"), "--model", model, "--data", data,
                            "--steps", "2", "--seq-len", "16", "--out", p("run-" + key), "--json"],
                           capture_output=True, text=True, timeout=300)
        if expect(r.returncode == 0, "zoffload trains on %s: %s" % (data, r.stderr[-2000:])):
            j = json.loads(r.stdout)
            expect(j["steps"] == 2 and 0 < j["first_loss"] < 20, "%s: 2 steps, a finite loss: %s" % (key, r.stdout))

report_and_exit()
