"""The build's update kernel under ncu: a warm-up build, then the profiled one, on saved rows.

    python -m benchmarks.profile_build DIR/embeddings.pt [name=value ...]     # prints the rounds
    ncu -k regex:update_kernel --launch-skip R --launch-count 1 --set full -o build \\
        python -m benchmarks.profile_build DIR/embeddings.pt [name=value ...]
    ncu -i build.ncu-rep --page details --section WarpStateStats --section SpeedOfLight

The first build is the warm-up. How many update rounds it launches depends on when its rounds
converge (``delta``), so the script prints it: with R that number, ``--launch-skip R`` lands on
the first round of the second build, ``R + r`` on its round r + 1. Build settings (any field of
BuildParams, ``name=value``) follow the path and apply to both builds.
"""
import argparse
import sys

import torch

import torch_grnnd as grnnd
from benchmarks.common import parse_settings


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="a saved {'base': rows, ...} file (benchmarks' text embeddings)")
    p.add_argument("settings", nargs="*", help="build settings, name=value")
    args = p.parse_args()
    params = parse_settings(",".join(args.settings))
    data = torch.load(args.path, map_location="cuda")["base"].contiguous()
    rounds = []
    grnnd.build(data, progress=lambda done, total: rounds.append(done), **params)
    torch.cuda.synchronize()
    print(f"warm-up build: {rounds[-1] if rounds else 0} update rounds", file=sys.stderr, flush=True)
    grnnd.build(data, **params)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
