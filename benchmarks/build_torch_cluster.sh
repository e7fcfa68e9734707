# torch_cluster's knn and radius only, for the comparisons in bench_pyg.py and
# tests/test_torch_cluster_parity.py on a machine without a torch_cluster wheel for its torch:
#
#     bash benchmarks/build_torch_cluster.sh torch_cluster-1.6.3.tar.gz [DIR]
#     PYTHONPATH=DIR/pkg python -m benchmarks.bench_pyg
#
# The argument is torch_cluster's source release from PyPI. Its own setup.py compiles 18
# extensions one after another (it had not finished after ten minutes on the GPU machine); these two, with ninja,
# take about a minute. DIR defaults to /tmp/torch_cluster_min.
set -e
SDIST=$(realpath "$1"); D=${2:-/tmp/torch_cluster_min}; rm -rf $D; mkdir -p $D/src $D/pkg/torch_cluster $D/lib
tar xzf "$SDIST" -C $D/src
S=$(ls -d $D/src/torch_cluster-*)
cp $S/torch_cluster/knn.py $S/torch_cluster/radius.py $D/pkg/torch_cluster/
cat > $D/pkg/torch_cluster/__init__.py <<PY
import torch
torch.ops.load_library("$D/lib/tc_knn_radius.so")
__version__ = "$(basename $S | cut -d- -f2)"
from .knn import knn, knn_graph
from .radius import radius, radius_graph
PY
python3 - <<PY
from torch.utils.cpp_extension import load
S = "$S/csrc"
load("tc_knn_radius", [f"{S}/knn.cpp", f"{S}/cpu/knn_cpu.cpp", f"{S}/cuda/knn_cuda.cu", f"{S}/radius.cpp",
                       f"{S}/cpu/radius_cpu.cpp", f"{S}/cuda/radius_cuda.cu"],
     extra_cflags=["-O2", "-DWITH_CUDA", "-fopenmp"], extra_cuda_cflags=["-O2", "-DWITH_CUDA"], extra_include_paths=[S], extra_ldflags=["-fopenmp"],
     build_directory="$D/lib", is_python_module=False, verbose=False)
PY
PYTHONPATH=$D/pkg python3 -c "import torch_cluster, torch; x = torch.randn(100, 3, device='cuda'); print('torch_cluster ok', torch_cluster.knn_graph(x, 4).shape)"
