#!/usr/bin/env python3
# Not tokenize.py: that would shadow the stdlib's `tokenize` (torch → inspect → tokenize) for every script in tools/.
"""Turn text into the token files `zoffload train --data` reads, with the model's own tokenizer.

  tokenize_data.py --model DIR --input PATH [PATH ...] --out OUT.bin|OUT.jsonl
                   [--format text|jsonl|chat] [--field NAME] [--split paragraph|line|file]
                   [--no-eos] [--no-special-tokens] [--json] [-q]

The tokenizer is loaded from DIR with transformers (local files only, never the network) and every
id is checked against DIR/config.json's vocab_size (at its top or in "text_config"; where it names
none, transformers' default for its model_type). Input, by --format (default: jsonl for .jsonl
inputs, text otherwise):
  text   plain UTF-8; --split paragraph (default: blank lines separate documents), line (each
         non-blank line is a document) or file (each input file is one document, read whole).
  jsonl  one JSON object per line, the document's text in --field (default "text").
  chat   one JSON object per line with a list of {"role", "content"} messages in --field (default
         "messages"), rendered with the tokenizer's chat template. Only the assistant replies (with
         the template's end-of-turn tokens) keep their labels; everything else is -100.
Output, by the extension of --out:
  .bin   the llm.c token file: 256 little-endian int32 (magic 20240520, version 1 = uint16 tokens
         when vocab_size <= 65536, else 2 = uint32; the token count), then the tokens.
  .jsonl one line per document: {"input_ids": [...]}, and "labels" for chat.
text and jsonl documents are encoded as the tokenizer encodes a text by itself (with Llama's BOS,
for example; not with --no-special-tokens) and followed by its end-of-text token (eos_token_id; not
with --no-eos). Empty (or whitespace-only) documents are skipped. Progress goes to stderr, a summary line to stdout
(--json: a JSON object instead). The output is written to a temporary file next to --out and renamed
into place at the end; on any failure nothing is left and an existing --out is untouched. Errors
are one line, `tokenize_data: error: ...`; exit 2 for bad usage or input, 1 for an I/O failure.
Environment: ZO_TOKENIZE_ALLOW_TORCH=1 lets transformers import PyTorch, which this tool otherwise
hides from it to start faster; set it when an error says that hiding broke transformers.
See docs/training.md, "Tokenizing data".
"""
import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
import warnings

PROG = "tokenize_data"
LLMC_MAGIC = 20240520
LLMC_HEADER_INTS = 256
INT32_MAX = 2**31 - 1
IGNORE_LABEL = -100
# Documents are encoded in batches of about this much text (the tokenizer spreads a batch over threads).
BATCH_CHARS = 4 << 20
BATCH_DOCS = 4096
# The files transformers (5.x) builds a tokenizer's vocabulary from: tokenizer.json (the `tokenizers`
# serialization every fast tokenizer saves); else a SentencePiece or tiktoken model (Llama 1/2 and
# Mistral's tokenizer.model, Llama 3's original tokenizer.model, tiktoken.model) or Mistral's
# tekken.json, converted at load; else a byte-level BPE's vocab.json with its merges.txt (GPT-2,
# Qwen2). Without any of them AutoTokenizer does not fail: it builds the class's empty tokenizer
# (LlamaTokenizer: just <unk>, <s>, </s>) from tokenizer_config.json alone, which encodes every text
# to nothing.
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "tekken.json")
BPE_FILES = ("vocab.json", "merges.txt")
# Note [Tiny tokenizer]: a tokenizer that can write text has at least an alphabet: 256 bytes for a
# byte-level BPE or SentencePiece with byte fallback, every character of its training text
# otherwise. Fewer than 16 tokens cannot even spell the ten digits and a few letters, so such a
# tokenizer is a placeholder (the empty one above, vocabulary files or not), not the model's; only a
# toy model whose vocab_size is itself below 16 may have one that small. A tokenizer whose every
# token is special (no text token at all) is refused whatever its size.
MIN_TOKENIZER_TOKENS = 16
ALLOW_TORCH_ENV = "ZO_TOKENIZE_ALLOW_TORCH"
REQUIREMENTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "requirements.txt")


class Failure(Exception):
    """One error line and an exit code: 2 bad usage or input, 1 an I/O failure while running."""

    def __init__(self, message, code=2):
        super().__init__(message)
        self.code = code


class Terminated(BaseException):
    """SIGTERM, unwinding like Ctrl-C (no `except Exception` on the way stops it), so the temporary
    file is removed."""


def on_sigterm(signum, frame):
    raise Terminated()


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, as every other error, instead of argparse's usage block
        raise Failure(message + " (see --help)")


def parse_args(argv):
    first, _usage, rest = __doc__.split("\n\n", 2)  # argparse prints its own usage
    p = Parser(prog="tokenize_data.py", description=first + "\n\n" + rest, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR",
                   help="Hugging Face model directory: the tokenizer files and config.json (for vocab_size)")
    p.add_argument("--input", required=True, nargs="+", action="extend", metavar="PATH",
                   help="input file(s), read in order into one output; - reads stdin")
    p.add_argument("--out", required=True, metavar="PATH", help="OUT.bin (llm.c tokens) or OUT.jsonl (input_ids, labels)")
    p.add_argument("--format", choices=("text", "jsonl", "chat"),
                   help="input format (default: jsonl when the inputs end in .jsonl, else text)")
    p.add_argument("--field", metavar="NAME", help='JSON key of the text (jsonl, default "text") or of the messages '
                   '(chat, default "messages")')
    p.add_argument("--split", choices=("paragraph", "line", "file"), default="paragraph",
                   help="text: what one document is (default paragraph: blank lines separate documents)")
    p.add_argument("--no-eos", action="store_true", help="text, jsonl: do not append the end-of-text token to each document")
    p.add_argument("--no-special-tokens", action="store_true",
                   help="text, jsonl: encode the text alone, without the special tokens the tokenizer adds itself (e.g. BOS)")
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout instead of the summary line")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    a = p.parse_args(argv)

    if a.format is None:
        kinds = {"jsonl" if path.endswith(".jsonl") else "text" for path in a.input}
        if len(kinds) > 1:
            raise Failure("the inputs mix .jsonl and other files; say which they are with --format")
        a.format = kinds.pop()
    if a.field is None:
        a.field = "messages" if a.format == "chat" else "text"
    ext = os.path.splitext(a.out)[1]
    if ext not in (".bin", ".jsonl"):
        raise Failure("--out %s: the extension says what to write: .bin (llm.c tokens) or .jsonl (input_ids and labels)" % a.out)
    a.out_kind = ext[1:]
    if a.format == "chat" and a.out_kind == "bin":
        raise Failure("--format chat writes labels, which a .bin file cannot hold: use --out with .jsonl")
    if os.path.isdir(a.out):
        raise Failure("--out %s is a directory" % a.out)
    if a.input.count("-") > 1:
        raise Failure("--input - (stdin) given more than once")
    for path in a.input:
        if path == "-":
            continue
        if not os.path.exists(path):
            raise Failure("--input %s: no such file" % path)
        if os.path.isdir(path):
            raise Failure("--input %s is a directory (name its files)" % path)
        if os.path.exists(a.out) and os.path.samefile(path, a.out):
            raise Failure("--out %s is also an input" % a.out)
    return a


# ---- the model directory -------------------------------------------------------------------------

# Note [Default vocab_size]: transformers writes a nested config (a multimodal model's text_config)
# with only the values that differ from its class's defaults, so gemma-3-4b-it's config.json has no
# vocab_size anywhere: its text_config is Gemma3TextConfig's, whose default is 262208. Where
# config.json names no vocab_size at its top or in "text_config", the tool takes the one transformers
# loads the config with (AutoConfig, the model_type's default), once the tokenizer has imported
# transformers. A vocab_size that is there but not a positive integer is an error, not a default.
def read_vocab_size(model_dir):
    """config.json's vocab_size, at its top or in "text_config"; None where neither names one (Note
    [Default vocab_size])."""
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, "rb") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise Failure("%s: no such file (the model's config, for vocab_size)" % path)
    except (ValueError, UnicodeDecodeError) as e:
        raise Failure("%s: not valid JSON (%s)" % (path, e))
    except OSError as e:
        raise Failure("cannot read %s: %s" % (path, e.strerror or e), 1)
    text_config = config.get("text_config") if isinstance(config, dict) else None
    levels = [c for c in (config, text_config) if isinstance(c, dict)]
    for c in levels:
        if isinstance(c.get("vocab_size"), int) and c["vocab_size"] > 0:
            return c["vocab_size"]
    if not levels or any("vocab_size" in c for c in levels):
        raise Failure('%s: no positive integer "vocab_size"' % path)
    return None


def default_vocab_size(model_dir):
    """Note [Default vocab_size]: the vocab_size transformers gives the config (load_tokenizer first)."""
    path = os.path.join(model_dir, "config.json")
    try:
        config = sys.modules["transformers"].AutoConfig.from_pretrained(model_dir, local_files_only=True)
        n = config.get_text_config().vocab_size
    except Exception as e:  # ValueError for an unknown model_type, and whatever a config class raises
        blame = torch_blame(e)
        raise Failure('%s: no "vocab_size" (at its top or in "text_config"), and transformers cannot load the config '
                      'for its default: %s%s' % (path, first_line(e), "; " + blame if blame else ""), 1 if blame else 2)
    if not isinstance(n, int) or n <= 0:
        raise Failure('%s: no "vocab_size" (at its top or in "text_config"), and transformers\' default for it is %r'
                      % (path, n))
    return n


def check_model_dir(model_dir):
    if not os.path.isdir(model_dir):
        raise Failure("--model %s: no such directory" % model_dir)
    has = {f: os.path.isfile(os.path.join(model_dir, f)) for f in VOCAB_FILES + BPE_FILES}
    if any(has[f] for f in VOCAB_FILES) or all(has[f] for f in BPE_FILES):
        return
    missing = "%s without %s" % (BPE_FILES[0], BPE_FILES[1]) if has[BPE_FILES[0]] else \
        "%s without %s" % (BPE_FILES[1], BPE_FILES[0]) if has[BPE_FILES[1]] else "none of them"
    raise Failure("--model %s has no tokenizer vocabulary (%s, or %s with %s): %s" % (
        model_dir, ", ".join(VOCAB_FILES), BPE_FILES[0], BPE_FILES[1], missing))


def special_ids(tok):
    """The ids of the tokenizer's special tokens (its named ones and every added token marked special)."""
    ids = set(tok.all_special_ids)
    ids.update(i for i, t in getattr(tok, "added_tokens_decoder", {}).items() if getattr(t, "special", False))
    return ids


def check_tokenizer_size(tok, specials, vocab_size, model_dir):
    """Note [Tiny tokenizer]."""
    n, ordinary = len(tok), len(tok) - len(specials)
    if ordinary > 0 and n >= min(MIN_TOKENIZER_TOKENS, vocab_size):
        return
    raise Failure("the tokenizer of %s has %d token(s), %d of them special, for a model with vocab_size %d: "
                  "transformers built an empty %s, so a vocabulary file it needs (%s) is missing or empty"
                  % (model_dir, n, n - ordinary, vocab_size, type(tok).__name__,
                     " or ".join(sorted(set(getattr(tok, "vocab_files_names", {}).values()))) or "tokenizer.json"))


# Note [No torch]: tokenizing needs no PyTorch, but transformers imports it whenever it is
# installed, and that is most of the start-up (3.3 s with it here, 0.9 s without). A None entry in
# sys.modules makes `import torch` fail in this process only, so transformers runs in the
# tokenizers-only mode it has for machines without PyTorch. Another transformers version may not
# take that well (a module that imports torch unconditionally, or checks for it by importing it):
# any error whose cause mentions torch then says this block caused it (torch_blame), and
# ZO_TOKENIZE_ALLOW_TORCH=1 in the environment turns the block off.
torch_blocked = False
# torch or PyTorch as a word ("import of torch halted", "requires the PyTorch library", "name 'torch' is
# not defined"), not inside a path or a name such as /models/torch-llama.
TORCH_WORD = re.compile(r"(?<![\w/-])(py)?torch(?![\w/-])", re.IGNORECASE)


def block_torch():
    global torch_blocked
    if os.environ.get(ALLOW_TORCH_ENV, "") in ("", "0"):
        sys.modules.setdefault("torch", None)
        torch_blocked = sys.modules["torch"] is None


def torch_blame(e):
    """With Note [No torch]'s block on, and torch named anywhere in e or the exceptions behind it:
    the sentence that says so, else None."""
    if not torch_blocked:
        return None
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        mod = getattr(e, "name", None) if isinstance(e, ImportError) else None
        if (isinstance(mod, str) and mod.split(".")[0] == "torch") or TORCH_WORD.search(str(e)):
            return ("tokenize_data.py's block on PyTorch caused this (it hides torch from transformers to start "
                    "faster, which this transformers version does not take); %s=1 in the environment turns the "
                    "block off" % ALLOW_TORCH_ENV)
        e = e.__cause__ or e.__context__
    return None


def load_tokenizer(model_dir):
    """AutoTokenizer from local files only; transformers' warnings stay out of our stderr."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore")
    block_torch()
    import importlib
    for module in ("numpy", "tokenizers", "transformers"):  # numpy: the writers and --format chat use it
        try:
            importlib.import_module(module)
        except ImportError as e:
            blame = torch_blame(e)
            if blame:
                raise Failure("cannot import %s (%s): %s" % (module, first_line(e), blame), 1)
            raise Failure("%s cannot import %s (%s): install the tool's packages into the Python that runs it, "
                          "`%s -m pip install -r %s` (tools/setup.sh may have chosen a python3 other than this one)"
                          % (sys.executable, module, first_line(e), sys.executable, REQUIREMENTS), 1)
    transformers = sys.modules["transformers"]
    transformers.logging.set_verbosity_error()
    try:
        tok = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError, ... for unusable files
        blame = torch_blame(e)
        raise Failure("cannot load the tokenizer of %s: %s%s" % (model_dir, first_line(e), "; " + blame if blame else ""),
                      1 if blame else 2)
    return tok


def first_line(e):
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


# ---- reading documents ---------------------------------------------------------------------------

class Progress:
    """Bytes read, documents and tokens so far, shown on stderr at most every interval seconds:
    one line rewritten in place on a terminal, plain lines otherwise."""

    def __init__(self, total_bytes, quiet):
        self.tty = sys.stderr.isatty()
        self.quiet = quiet
        self.interval = 0.5 if self.tty else 5.0
        self.total_bytes = total_bytes
        self.bytes = 0
        self.docs = 0
        self.tokens = 0
        self.start = time.monotonic()
        self.last = self.start
        self.shown = False

    def tick(self):
        now = time.monotonic()
        if self.quiet or now - self.last < self.interval:
            return
        self.last = now
        done = human_bytes(self.bytes)
        if self.total_bytes:
            done += " of %s (%.1f%%)" % (human_bytes(self.total_bytes), 100.0 * self.bytes / self.total_bytes)
        rate = self.tokens / max(now - self.start, 1e-9)
        line = "%s: %s, %s documents, %s tokens, %s tokens/s" % (
            PROG, done, f"{self.docs:,}", human_count(self.tokens), human_count(rate))
        if self.tty:
            sys.stderr.write("\r\x1b[K" + line)
            self.shown = True
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def clear(self):
        if self.shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
            self.shown = False


def human_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return ("%d %s" % (n, unit)) if unit == "B" else ("%.1f %s" % (n, unit))
        n /= 1024.0


def human_count(n):
    if n < 1e4:
        return "%d" % n
    if n < 1e6:
        return "%.1f k" % (n / 1e3)
    if n < 1e9:
        return "%.1f M" % (n / 1e6)
    return "%.2f G" % (n / 1e9)


def input_lines(path, progress):
    """(line number, raw bytes line) of one input, counting bytes for the progress."""
    try:
        f = sys.stdin.buffer if path == "-" else open(path, "rb")
    except OSError as e:
        raise Failure("cannot open %s: %s" % (path, e.strerror or e), 1)
    with f:
        n = 0
        while True:
            try:
                raw = f.readline()
            except OSError as e:
                raise Failure("cannot read %s after line %d: %s" % (name(path), n, e.strerror or e), 1)
            if not raw:
                return
            n += 1
            progress.bytes += len(raw)
            if n == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark is no text
                raw = raw[3:]
            yield n, raw


def name(path):
    return "<stdin>" if path == "-" else path


def decode(raw, where):
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Failure("%s: not valid UTF-8 (byte %d of the line)" % (where, e.start + 1))


def text_documents(paths, split, progress):
    """(where, text): paragraph = runs of non-blank lines, line = each non-blank line (without its
    line break), file = a whole file as it is."""
    for path in paths:
        if split == "file":
            parts = [decode(raw, "%s:%d" % (name(path), n)) for n, raw in input_lines(path, progress)]
            yield name(path), "".join(parts)
            continue
        lines, start = [], 0
        for n, raw in input_lines(path, progress):
            where = "%s:%d" % (name(path), n)
            s = decode(raw, where)
            if not s.strip():
                if lines:
                    yield "%s:%d" % (name(path), start), strip_line_break("".join(lines))
                    lines = []
            elif split == "line":
                yield where, strip_line_break(s)
            else:
                if not lines:
                    start = n
                lines.append(s)
        if lines:
            yield "%s:%d" % (name(path), start), strip_line_break("".join(lines))


def strip_line_break(s):
    if s.endswith("\r\n"):
        return s[:-2]
    return s[:-1] if s.endswith("\n") else s


def json_records(paths, field, progress):
    """(where, value of `field`) of each non-blank line."""
    for path in paths:
        for n, raw in input_lines(path, progress):
            if not raw.strip():
                continue
            where = "%s:%d" % (name(path), n)
            try:
                obj = json.loads(raw.rstrip(b"\r\n"))
            except UnicodeDecodeError as e:
                raise Failure("%s: not valid UTF-8 (%s)" % (where, e.reason))
            except RecursionError:
                raise Failure("%s: JSON nested too deeply to read (more than about %d levels)"
                              % (where, sys.getrecursionlimit()))
            except ValueError as e:
                msg = getattr(e, "msg", str(e))
                col = getattr(e, "colno", None)
                raise Failure("%s: not valid JSON (%s%s)" % (where, msg, ", column %d" % col if col else ""))
            if not isinstance(obj, dict):
                raise Failure("%s: expected a JSON object, got %s" % (where, json_type(obj)))
            if field not in obj:
                keys = ", ".join('"%s"' % k for k in list(obj)[:8]) or "none"
                raise Failure('%s: no "%s" field (its keys: %s; --field names another)' % (where, field, keys))
            yield where, obj[field]


def json_type(v):
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(v), type(v).__name__)


# Note [Lone surrogates]: JSON writes any UTF-16 code unit as an escape, so "\ud800" without its low
# half is valid JSON, and json.loads also decodes surrogates encoded as UTF-8 bytes (it reads bytes
# with 'surrogatepass'). Either gives a str that holds U+D800..U+DFFF alone, which no UTF-8 encodes:
# the tokenizer (and the chat template's output) fails on it with a traceback, far from the line.
# Every string of the field's value is checked where it is read instead. A pair of escapes that
# makes one character (\ud83d\ude00) is joined by json.loads and is not one.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def check_surrogates(where, path, value):
    """Note [Lone surrogates]: refuses a lone surrogate in any string (or key) of value, naming where
    it is (path: value's name). Iterative: value may nest as deep as json.loads allows."""
    stack = [(path, value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            m = LONE_SURROGATE.search(v)
            if m:
                raise Failure("%s: %s holds a lone UTF-16 surrogate (\\u%04x at character %d), which is not text: "
                              "no UTF-8 encodes it" % (where, path, ord(m.group()), m.start() + 1))
        elif isinstance(v, list):
            stack.extend(("%s[%d]" % (path, i), x) for i, x in reversed(list(enumerate(v))))
        elif isinstance(v, dict):
            for k, x in reversed(list(v.items())):
                # A key is untrusted text: named as JSON (escaped, one line) and bounded unless a plain word.
                stack.append((("%s.%s" % (path, k)) if re.fullmatch(r"\w{1,40}", k, re.ASCII)
                              else "%s[%s]" % (path, json.dumps(k)[:40]), x))
                stack.append(("a key of %s" % path, k))


def jsonl_documents(paths, field, progress):
    for where, value in json_records(paths, field, progress):
        if not isinstance(value, str):
            raise Failure('%s: "%s" is %s, not a string' % (where, field, json_type(value)))
        check_surrogates(where, '"%s"' % field, value)
        yield where, value


def chat_documents(paths, field, progress):
    for where, value in json_records(paths, field, progress):
        if not isinstance(value, list):
            raise Failure('%s: "%s" is %s, not a list of messages' % (where, field, json_type(value)))
        for i, m in enumerate(value):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise Failure('%s: %s[%d] is not a message: expected an object with a string "role"' % (where, field, i))
        check_surrogates(where, field, value)
        yield where, value


def batched(docs):
    batch, chars = [], 0
    for where, doc in docs:
        batch.append((where, doc))
        chars += len(doc) if isinstance(doc, str) else sum(len(str(m.get("content", ""))) for m in doc)
        if chars >= BATCH_CHARS or len(batch) >= BATCH_DOCS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


# ---- encoding ------------------------------------------------------------------------------------

class Encoder:
    def __init__(self, tok, args):
        self.tok = tok
        self.backend = getattr(tok, "backend_tokenizer", None)
        self.add_special = not args.no_special_tokens
        self.eos = None
        if args.format != "chat" and not args.no_eos:
            self.eos = tok.eos_token_id
            if self.eos is None:
                raise Failure("the tokenizer of %s has no end-of-text token (eos_token) to end each document with; "
                              "--no-eos writes the documents without one" % args.model)

    def encode(self, texts):
        """Token ids of each text, the end-of-text token appended where it is not already last."""
        if self.backend is not None:
            batch = [e.ids for e in self.backend.encode_batch_fast(texts, add_special_tokens=self.add_special)]
        else:
            batch = self.tok(texts, add_special_tokens=self.add_special)["input_ids"]
        if self.eos is not None:
            for ids in batch:
                if not ids or ids[-1] != self.eos:
                    ids.append(self.eos)
        return batch


# Note [Assistant spans]: the labels of a conversation come from rendering it incrementally. For
# each assistant message i, before = render(messages[:i], add_generation_prompt=True) must be a
# prefix of through = render(messages[:i+1]) and of the whole conversation's rendering; the reply is
# the text between before and through: its content and whatever the template closes the turn with
# (end-of-turn token, line break). Where through is a prefix of the whole rendering too, that text is
# the reply there. Otherwise the template renders the reply differently once more messages follow,
# and two such changes are known (Note [Changed replies]); the reply is then the text of the
# reply as through has it less one or both, found verbatim right after before in the whole
# rendering, and a template that changes earlier turns in any other way is refused. The whole
# rendering is then encoded once without added special tokens (the template writes its own, as
# apply_chat_template(tokenize=True) does) and a token keeps its label when its characters overlap
# a reply.
#
# Note [Changed replies]: what templates do to a reply that is not the last message.
#  - They drop its reasoning: Qwen3 opens the last reply after the last user message with a
#    <think>...</think> block (empty, "<think>\n\n</think>\n\n", when the message has no reasoning)
#    and renders earlier replies without it. The reply in the whole rendering is the rest of it
#    (the block, the whitespace after it, or part of that whitespace, cut from its head), so an
#    earlier reply is labelled from its answer on and the last one with its block.
#  - They end the conversation with the end-of-text token after the last message, where no
#    generation prompt follows (Phi-3 and Phi-4-mini write eos_token there). An earlier
#    reply ends before it (at its <|end|>); the last reply keeps it, as what the template closes it
#    with.
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ChatEncoder:
    def __init__(self, tok, model_dir):
        if getattr(tok, "backend_tokenizer", None) is None:
            raise Failure("--format chat needs a fast tokenizer (tokenizer.json) for character offsets; "
                          "%s has a slow one" % model_dir)
        if not tok.chat_template:
            raise Failure("the tokenizer of %s has no chat template (tokenizer_config.json \"chat_template\" or "
                          "chat_template.jinja), which --format chat renders conversations with" % model_dir)
        self.tok = tok
        self.backend = tok.backend_tokenizer
        self.eos_text = tok.eos_token

    def render(self, messages, generation_prompt, where):
        try:
            text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as e:  # jinja2 errors, raise_exception() in the template, ...
            blame = torch_blame(e)
            raise Failure("%s: the chat template failed on %d message(s): %s%s" % (
                where, len(messages), first_line(e), "; " + blame if blame else ""), 1 if blame else 2)
        if not isinstance(text, str):
            raise Failure("%s: the chat template rendered %s, not a string" % (where, type(text).__name__))
        return text

    def spans(self, messages, where):
        """The whole rendering and the [begin, end) character spans of the assistant replies (Note
        [Assistant spans])."""
        full = self.render(messages, False, where)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], True, where)
            through = self.render(messages[:i + 1], False, where)
            if not through.startswith(before):
                problem = "with the generation prompt is not a prefix of rendering it with the reply"
            elif not full.startswith(before):
                problem = "with the generation prompt is not a prefix of rendering all of it"
            else:
                reply = self.reply_in(full, len(before), through[len(before):])
                if reply is not None:
                    if reply:
                        spans.append((len(before), len(before) + len(reply)))
                    continue
                problem = ("with the reply is not a prefix of rendering all of it, nor is it without a leading %s...%s "
                           "block or a closing end-of-text token" % (THINK_OPEN, THINK_CLOSE))
            raise Failure("%s: the chat template is not prefix-stable at message %d (assistant): rendering the "
                          "conversation up to it %s, so its reply's tokens cannot be told apart" % (where, i, problem))
        return full, spans

    def reply_in(self, full, begin, reply):
        """The reply as full has it at begin: reply itself, or reply less the changes of Note
        [Changed replies]; None where it is none of them."""
        if full.startswith(reply, begin):
            return reply
        tails = [reply]
        if self.eos_text and reply.endswith(self.eos_text) and len(reply) > len(self.eos_text):
            tails.append(reply[:-len(self.eos_text)])
        for tail in tails:
            for cut in [0] + self.reasoning_cuts(tail):
                kept = tail[cut:]
                if kept and full.startswith(kept, begin):
                    return kept
        return None

    @staticmethod
    def reasoning_cuts(reply):
        """Where a leading <think>...</think> block of reply ends, and each place in the whitespace after it."""
        opened = len(reply) - len(reply.lstrip())
        if not reply.startswith(THINK_OPEN, opened):
            return []
        close = reply.find(THINK_CLOSE, opened + len(THINK_OPEN))
        if close < 0:
            return []
        end = close + len(THINK_CLOSE)
        cuts = [end]
        while end < len(reply) and reply[end].isspace():
            end += 1
            cuts.append(end)
        return cuts

    def encode(self, conversations):
        """(input_ids, labels) of each (where, messages)."""
        import numpy as np
        rendered = [self.spans(messages, where) for where, messages in conversations]
        encodings = self.backend.encode_batch([text for text, _ in rendered], add_special_tokens=False)
        out = []
        for (_, spans), e in zip(rendered, encodings):
            ids = e.ids
            offsets = np.asarray(e.offsets, dtype=np.int64).reshape(-1, 2)
            begin, end = offsets[:, 0], np.maximum(offsets[:, 1], offsets[:, 0] + 1)
            keep = np.zeros(len(ids), dtype=bool)
            for b, en in spans:
                keep |= (begin < en) & (end > b)
            labels = np.where(keep, np.asarray(ids, dtype=np.int64), IGNORE_LABEL).tolist()
            out.append((ids, labels))
        return out


# ---- writing -------------------------------------------------------------------------------------

class BinWriter:
    """llm.c tokens: the header with a zero count, the tokens as they come, then the count."""

    def __init__(self, f, vocab_size):
        import numpy as np
        self.np = np
        self.f = f
        self.version = 1 if vocab_size <= 65536 else 2
        self.dtype = np.dtype("<u2" if self.version == 1 else "<u4")
        self.count = 0
        f.write(self.header())  # the caller turns an OSError into a Failure

    def header(self):
        h = self.np.zeros(LLMC_HEADER_INTS, dtype="<i4")
        h[0], h[1], h[2] = LLMC_MAGIC, self.version, self.count
        return h.tobytes()

    def add(self, batch):
        n = sum(len(ids) for ids, _ in batch)
        if self.count + n > INT32_MAX:
            raise Failure("more than %d tokens do not fit an llm.c header's int32 count; split the input into "
                          "several files" % INT32_MAX)
        self.f.write(self.np.concatenate([self.np.asarray(ids, dtype=self.dtype) for ids, _ in batch]).tobytes())
        self.count += n

    def finish(self):
        self.f.seek(0)
        self.f.write(self.header())


class JsonlWriter:
    def __init__(self, f):
        self.f = f

    def add(self, batch):
        lines = []
        for ids, labels in batch:
            obj = {"input_ids": ids} if labels is None else {"input_ids": ids, "labels": labels}
            lines.append(json.dumps(obj, separators=(",", ":")))
        self.f.write(("\n".join(lines) + "\n").encode())

    def finish(self):
        pass


class AtomicOutput:
    """A temporary file next to `path`, renamed onto it by commit(); removed (with the directories
    made for it) by abort()."""

    def __init__(self, path):
        self.path = path
        parent = os.path.dirname(os.path.abspath(path))
        self.made_dirs = []
        d = parent
        while not os.path.exists(d):
            self.made_dirs.append(d)
            d = os.path.dirname(d)
        fd = self.tmp = None
        try:
            os.makedirs(parent, exist_ok=True)
            fd, self.tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=parent)
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(fd, 0o666 & ~umask)  # as open() would make it, not mkstemp's 0600
            self.f = os.fdopen(fd, "w+b", buffering=1 << 20)
        except OSError as e:
            if fd is not None:
                os.close(fd)
                try:
                    os.unlink(self.tmp)
                except OSError:
                    pass
            self.remove_dirs()
            raise Failure("cannot create a file in %s: %s" % (parent, e.strerror or e), 1)

    def commit(self):
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.path)

    def abort(self):
        try:
            self.f.close()
        except OSError:
            pass
        try:
            os.unlink(self.tmp)
        except OSError:
            pass
        self.remove_dirs()

    def remove_dirs(self):
        for d in self.made_dirs:
            try:
                os.rmdir(d)
            except OSError:
                break


# ---- main ----------------------------------------------------------------------------------------

def check_vocab(batch, wheres, vocab_size, tok):
    for (ids, _), where in zip(batch, wheres):
        if ids and max(ids) >= vocab_size:
            bad = next(t for t in ids if t >= vocab_size)
            piece = tok.convert_ids_to_tokens(bad)
            raise Failure("%s: token id %d (%r) is not below the model's vocab_size %d (config.json)"
                          % (where, bad, piece, vocab_size))


def check_text_tokens(encoded, kept, specials, special_texts, text_of):
    """Refuses a document that encodes to special tokens only although its text is more than the
    literal text of special tokens (a document that is just "<|endoftext|>" is fine): its words
    were lost, which is what an empty or wrong vocabulary does (Note [Tiny tokenizer])."""
    for (ids, _), (where, doc) in zip(encoded, kept):
        if any(t not in specials for t in ids):  # stops at the first text token: BOS aside, the first one
            continue
        rest = text_of(where, doc)
        for s in special_texts:
            rest = rest.replace(s, "")
        if rest.strip():
            raise Failure("%s: the text encodes to special tokens only (ids %s%s), none of its own: the tokenizer "
                          "cannot write it (is its vocabulary file missing or the wrong one?)"
                          % (where, ", ".join(map(str, ids[:8])) or "none", ", ..." if len(ids) > 8 else ""))


def run(args):
    started = time.monotonic()
    check_model_dir(args.model)
    vocab_size = read_vocab_size(args.model)
    tok = load_tokenizer(args.model)
    if vocab_size is None:
        vocab_size = default_vocab_size(args.model)
    specials = special_ids(tok)
    check_tokenizer_size(tok, specials, vocab_size, args.model)
    special_texts = sorted({t for t in tok.convert_ids_to_tokens(sorted(specials)) if t}, key=len, reverse=True)
    if args.format == "chat":
        encoder = ChatEncoder(tok, args.model)
    else:
        encoder = Encoder(tok, args)
    total = sum(os.path.getsize(p) for p in args.input if p != "-" and os.path.isfile(p))
    progress = Progress(total if "-" not in args.input else 0, args.quiet or args.json)
    if args.format == "chat":
        documents = chat_documents(args.input, args.field, progress)
    elif args.format == "jsonl":
        documents = jsonl_documents(args.input, args.field, progress)
    else:
        documents = text_documents(args.input, args.split, progress)

    out = AtomicOutput(args.out)
    stats = {"documents": 0, "skipped_empty": 0, "tokens": 0, "labelled_tokens": 0, "without_reply": 0}
    if args.format == "chat":
        text_of = lambda where, messages: encoder.spans(messages, where)[0]  # noqa: E731
    else:
        text_of = lambda where, text: text  # noqa: E731
    try:
        try:
            writer = BinWriter(out.f, vocab_size) if args.out_kind == "bin" else JsonlWriter(out.f)
        except OSError as e:
            raise Failure("cannot write %s: %s" % (out.tmp, e.strerror or e), 1)
        for batch in batched(documents):
            kept = [(w, d) for w, d in batch if (d.strip() if isinstance(d, str) else d)]
            stats["skipped_empty"] += len(batch) - len(kept)
            if not kept:
                continue
            wheres = [w for w, _ in kept]
            if args.format == "chat":
                encoded = encoder.encode(kept)
                for _, labels in encoded:
                    n = sum(1 for l in labels if l != IGNORE_LABEL)
                    stats["labelled_tokens"] += n
                    stats["without_reply"] += n == 0
            else:
                encoded = [(ids, None) for ids in encoder.encode([d for _, d in kept])]
                stats["labelled_tokens"] += sum(len(ids) for ids, _ in encoded)
            check_vocab(encoded, wheres, vocab_size, tok)
            check_text_tokens(encoded, kept, specials, special_texts, text_of)
            try:
                writer.add(encoded)
            except OSError as e:
                raise Failure("cannot write %s: %s" % (out.tmp, e.strerror or e), 1)
            stats["documents"] += len(encoded)
            stats["tokens"] += sum(len(ids) for ids, _ in encoded)
            progress.docs, progress.tokens = stats["documents"], stats["tokens"]
            progress.tick()
        if stats["documents"] == 0:
            raise Failure("%s: no document with any text" % ", ".join(name(p) for p in args.input))
        try:
            writer.finish()
            out.commit()
        except OSError as e:
            raise Failure("cannot write %s: %s" % (args.out, e.strerror or e), 1)
    except BaseException:
        progress.clear()
        out.abort()
        raise
    progress.clear()
    seconds = time.monotonic() - started
    summary = {
        "out": args.out,
        "out_format": "llmc" if args.out_kind == "bin" else "jsonl",
        "llmc_version": writer.version if args.out_kind == "bin" else None,
        "format": args.format,
        "inputs": [name(p) for p in args.input],
        "input_bytes": progress.bytes,
        "documents": stats["documents"],
        "skipped_empty": stats["skipped_empty"],
        "tokens": stats["tokens"],
        "labelled_tokens": stats["labelled_tokens"],
        "vocab_size": vocab_size,
        "eos_token_id": getattr(encoder, "eos", None),
        "seconds": round(seconds, 3),
        "tokens_per_s": round(stats["tokens"] / max(seconds, 1e-9)),
    }
    if args.format == "chat":
        summary["conversations_without_reply"] = stats["without_reply"]
    if args.json:
        print(json.dumps(summary))
    elif not args.quiet:
        what = ("llm.c version %d, uint%d tokens" % (writer.version, 16 if writer.version == 1 else 32)
                if args.out_kind == "bin" else "JSONL")
        kind = ("conversation" if args.format == "chat" else "document") + ("" if stats["documents"] == 1 else "s")
        line = "wrote %s (%s): %s %s, %s tokens" % (args.out, what, f"{stats['documents']:,}", kind, f"{stats['tokens']:,}")
        if args.format == "chat":
            line += " (%s with labels)" % f"{stats['labelled_tokens']:,}"
        line += " from %s in %.1f s" % (human_bytes(progress.bytes), seconds)
        print(line)
        if stats["without_reply"]:
            print("%s: note: %d conversation(s) have no assistant reply, so no labels" % (PROG, stats["without_reply"]),
                  file=sys.stderr)


def main(argv):
    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        run(parse_args(argv))
    except Failure as e:
        print("%s: error: %s" % (PROG, e), file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("%s: error: interrupted; nothing written" % PROG, file=sys.stderr)
        return 130
    except Terminated:
        print("%s: error: terminated (SIGTERM); nothing written" % PROG, file=sys.stderr)
        return 143
    except Exception as e:  # a traceback, unless Note [No torch]'s block is behind it
        blame = torch_blame(e)
        if blame is None:
            raise
        print("%s: error: %s: %s; %s" % (PROG, type(e).__name__, first_line(e), blame), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
