"""Peak memory of gathering token log-probs: chunked (the probe's) vs a naive full log-softmax.

    .venv/bin/python benchmarks/bench_rescore_memory.py [--tokens 8192] [--vocab 151936] [--hidden 512]

Method: each measurement runs in a fresh child process. The child builds the inputs (hidden states
[tokens, hidden] and an LM head [vocab, hidden], float32), reads its peak RSS (ru_maxrss), runs the
gather, and reads ru_maxrss again; the difference is the memory the gather itself needed on top of
its inputs. torch's CPU tensors live in ordinary process memory, so RSS sees them (tracemalloc does not).

naive = `torch.log_softmax(hidden @ W.T / T, -1).gather(...)`: two [tokens, vocab] float32 tensors
(5 GB each at 8k x 152k). It is measured at smaller token counts (--naive-tokens) and extrapolated
linearly to --tokens, since its memory grows linearly with tokens; the output says which is which.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

from mismatch_probe.engines.forward.logprobs import DEFAULT_CHUNK

GB = 1e9


def peak_rss() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def child(mode: str, tokens: int, vocab: int, hidden: int, chunk: int) -> None:
    import torch

    from mismatch_probe.engines.forward.logprobs import gather_logprobs

    torch.manual_seed(0)
    torch.set_num_threads(1)
    states = torch.randn(tokens, hidden)
    head = torch.randn(vocab, hidden) / hidden**0.5
    targets = torch.randint(0, vocab, (tokens,))
    project = lambda h: h @ head.T  # noqa: E731
    before = peak_rss()
    with torch.no_grad():
        if mode == "chunked":
            logprob = gather_logprobs(states, targets, project, 1.0, chunk=chunk)[0]
        else:
            logprob = torch.log_softmax(project(states) / 1.0, dim=-1).gather(-1, targets[:, None])[:, 0]
    print(json.dumps({"extra": peak_rss() - before, "inputs": before, "check": float(logprob.sum())}))


def measure(mode: str, tokens: int, args) -> dict:
    command = [
        sys.executable,
        __file__,
        "--child",
        mode,
        "--tokens",
        str(tokens),
        "--vocab",
        str(args.vocab),
        "--hidden",
        str(args.hidden),
        "--chunk",
        str(args.chunk),
    ]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=512, help="hidden size (only the inputs' size depends on it)")
    parser.add_argument(
        "--chunk",
        type=int,
        default=DEFAULT_CHUNK,
        help="rows of logits at once in the chunked gather (default: the engines' default)",
    )
    parser.add_argument(
        "--naive-tokens", default="512,1024", help="token counts at which the naive version is measured"
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.tokens, args.vocab, args.hidden, args.chunk)

    full = args.tokens * args.vocab * 4
    print(f"{args.tokens} tokens x {args.vocab} vocab; one [tokens, vocab] float32 tensor = {full / GB:.2f} GB")
    chunked = measure("chunked", args.tokens, args)
    print(
        f"chunked (chunk {args.chunk}), measured at {args.tokens} tokens: peak {chunked['extra'] / GB:.3f} GB "
        f"above its inputs ({chunked['inputs'] / GB:.2f} GB)"
    )
    points = [(n, measure("naive", n, args)["extra"]) for n in map(int, args.naive_tokens.split(","))]
    for n, extra in points:
        print(f"naive, measured at {n} tokens: peak {extra / GB:.3f} GB above its inputs")
    (n0, e0), (n1, e1) = points[0], points[-1]
    slope = (e1 - e0) / (n1 - n0) if n1 != n0 else e1 / n1
    naive = e1 + slope * (args.tokens - n1)
    print(f"naive, extrapolated linearly to {args.tokens} tokens: peak {naive / GB:.2f} GB above its inputs")
    print(
        f"chunked needs {chunked['extra'] / naive * 100:.1f} % of the naive peak ({naive / chunked['extra']:.0f}x less)"
    )


if __name__ == "__main__":
    main()
