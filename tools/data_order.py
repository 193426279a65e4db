"""zoffload's token files and window order, for Python that must feed a reference the batches
`zoffload train` reads: the llm.c .bin writer (engine/data/token_source.h) and the window
permutation of each epoch (docs/training.md, Data/Order; engine/data/shuffle.cpp). Used by
tools/quality_bench.py and tests/tools/hf_parity_test.py."""
import numpy as np

M64 = (1 << 64) - 1


def write_llmc(path, tokens):
    """llm.c .bin: a 256-int32 header (magic, version 1 = uint16 tokens, count), then the tokens."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = [20240520, 1, len(tokens)]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype="<u2").tobytes())


def mix64(x):
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def epoch_permutation(n, seed, epoch):
    """The order of n windows in `epoch`: Fisher–Yates from n−1 down to 1 driven by splitmix64 started
    at mix64(seed ^ mix64(epoch)), bounded draws by Lemire's multiply-and-reject. `zoffload train`
    always shuffles (its config has no key to turn it off), so a reference takes the windows in this
    documented order."""
    state = mix64(seed ^ mix64(epoch))

    def below(bound):
        nonlocal state
        while True:
            state = (state + 0x9E3779B97F4A7C15) & M64
            m = mix64(state) * bound
            if (m & M64) >= ((1 << 64) - bound) % bound:
                return m >> 64

    order = list(range(n))
    for i in range(n, 1, -1):
        j = below(i)
        order[i - 1], order[j] = order[j], order[i - 1]
    return order
