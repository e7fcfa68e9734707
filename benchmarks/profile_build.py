"""The build launches ncu profiles: a warm-up build, then the profiled one, on real embeddings.

    ncu -k regex:update_kernel --launch-skip 24 --launch-count 1 --set full -o build \\
        python benchmarks/profile_build.py DIR/embeddings.pt
    ncu -i build.ncu-rep --page details --section WarpStateStats --section SpeedOfLight

The first build is the warm-up: with the default parameters it launches 18 update rounds
(3 outer x 6 inner), so --launch-skip 24 lands on the seventh round of the second build, the
first of its second outer iteration. Build parameters can be given after the path, e.g.
pool_size=64 (then count the rounds again).
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch_grnnd as grnnd  # noqa: E402
from benchmarks.bench_gpu import parse_build  # noqa: E402


def main(path: str, overrides: list):
    params = parse_build(",".join(overrides))
    data = torch.load(path, map_location="cuda")["base"].contiguous()
    for _ in range(2):
        grnnd.build(data, **params)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
