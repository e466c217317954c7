"""Summarize a py-spy speedscope profile: where each thread's samples go.

    python -m bench.profile_summary bench/results/rill-chat.speedscope.json [--top 25] [--thread engine]

For each thread (py-spy writes one profile per thread): its share of all samples, then the
functions with the most inclusive samples (on the stack) and the most self samples (at the
top of the stack). `make bench` writes the profile with `python -m bench.suite --profile`.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter


def summarize(path: str, top: int = 25, thread_filter: str | None = None) -> str:
    doc = json.loads(open(path).read())
    frames = doc["shared"]["frames"]

    def name(i: int) -> str:
        f = frames[i]
        file = (f.get("file") or "").split("site-packages/")[-1].split("/work/main/")[-1]
        return f"{f['name']} ({file}:{f.get('line', '?')})"

    profiles = doc["profiles"]
    total = sum(sum(p.get("weights") or [1] * len(p["samples"])) for p in profiles) or 1
    out = [f"{path}: {len(profiles)} threads, {total} samples"]
    for p in sorted(profiles, key=lambda p: -sum(p.get("weights") or [1] * len(p["samples"]))):
        if thread_filter and thread_filter not in p["name"]:
            continue
        weights = p.get("weights") or [1] * len(p["samples"])
        n = sum(weights)
        if n < total * 0.02 and not thread_filter:
            continue
        inclusive: Counter[int] = Counter()
        self_time: Counter[int] = Counter()
        for stack, w in zip(p["samples"], weights):
            if not stack:
                continue
            self_time[stack[-1]] += w
            for frame in set(stack):
                inclusive[frame] += w
        out.append(f"\n## {p['name']}: {n} samples ({100 * n / total:.0f}% of all)")
        out.append("  inclusive:")
        for frame, w in inclusive.most_common(top):
            out.append(f"    {100 * w / n:5.1f}%  {name(frame)}")
        out.append("  self:")
        for frame, w in self_time.most_common(max(10, top // 2)):
            out.append(f"    {100 * w / n:5.1f}%  {name(frame)}")
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("profile")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--thread", help="only threads whose name contains this")
    args = p.parse_args(argv)
    print(summarize(args.profile, args.top, args.thread))


if __name__ == "__main__":
    main()
