// The op schemas of torch.ops.grnnd: the single place that declares them and their defaults.
// Kernels register themselves next to their code (csrc/cpu/, csrc/cuda/, csrc/pyg/knn_graph.cpp).
#include <Python.h>

#include <torch/library.h>

#include "core/progress.h"

// Without CUDA kernels in this build, CUDA tensors get a message that says why and what to do,
// instead of the dispatcher's generic "could not run ... with arguments from the 'CUDA' backend".
// One boxed kernel serves every op (it needs no signature). It is registered for each op with a
// CPU kernel (device kernels come in CPU and CUDA pairs; composite ops such as knn_graph run on
// what their parts run on) when the module is imported: by then every file of the library has
// registered its kernels, whatever order their static initialisers ran in.
#ifndef GRNND_WITH_CUDA
namespace {
void no_cuda_kernel(const c10::OperatorHandle& op, torch::jit::Stack*) {
  TORCH_CHECK(false, "torch.ops.", op.schema().name(),
              " got CUDA tensors, but torch_grnnd was installed without CUDA kernels (torch_grnnd.info() says "
              "why). Reinstall with nvcc and a CUDA build of torch present, or move the tensors to the CPU.");
}

void register_cuda_stubs() {
  static bool registered = false;  // an import after a failed one runs this again
  if (registered) return;
  registered = true;
  static torch::Library library(torch::Library::IMPL, "grnnd", c10::DispatchKey::CUDA, __FILE__, __LINE__);
  const std::string prefix = "grnnd::";
  for (const c10::OperatorName& name : c10::Dispatcher::singleton().getAllOpNames()) {
    if (name.name.rfind(prefix, 0) != 0) continue;
    const auto op = c10::Dispatcher::singleton().findOp(name);
    if (op.has_value() && op->hasKernelForDispatchKey(c10::DispatchKey::CPU) &&
        !op->hasKernelForDispatchKey(c10::DispatchKey::CUDA)) {
      library.impl(name.name.substr(prefix.size()).c_str(),
                   torch::CppFunction::makeFromBoxedFunction<&no_cuda_kernel>());
    }
  }
}
}  // namespace
#endif

// Importing torch_grnnd._C loads this library, which runs the registrations below. The module
// itself carries the hook for build progress (torch_grnnd/progress.py) and what the build holds.
extern "C" PyObject* PyInit__C(void) {
#ifndef GRNND_WITH_CUDA
  try {
    register_cuda_stubs();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_ImportError, e.what());
    return nullptr;
  }
#endif
  static PyMethodDef methods[] = {
      {"_set_progress_callback", grnnd::set_progress_callback, METH_O,
       "Install (or with None remove) the calling thread's build progress callback(done, total)."},
      {nullptr, nullptr, 0, nullptr}};
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  PyObject* module = PyModule_Create(&module_def);
  // The torch release (major * 100 + minor) this build was compiled against (setup.py), and
  // whether it holds the CUDA kernels (torch_grnnd.info()).
#ifdef GRNND_WITH_CUDA
  constexpr long kWithCuda = 1;
#else
  constexpr long kWithCuda = 0;
#endif
  if (module != nullptr && (PyModule_AddIntConstant(module, "torch_release", GRNND_TORCH_RELEASE) < 0 ||
                            PyModule_AddIntConstant(module, "with_cuda", kWithCuda) < 0)) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}

TORCH_LIBRARY(grnnd, m) {
  // GRNND graph build (seed 000, Algorithm 3). Defaults were measured: benchmarks/tune_build.py.
  // init: optional int32 [N, c] entries each vertex starts with besides its S draws, as already
  // compared ("old", seed 003's merge of built graphs), -1 padded (build_schedule.h, start_entries).
  // init_split: where a merge's second graph starts (init_mode "merge"; each row then draws
  // from the other graph, hubs.h, initial_neighbour) or a graph's new rows (init_mode "grow",
  // Index.add); build_schedule.h, Split. 0: draws from all rows.
  // widen: a build from scratch whose rows stay hard to find widens its pools and rows as it goes
  // (build_schedule.h, kWidenShare), so its graph may be wider than `degree`.
  // pair_code_rows, pair_code_scale: one-byte codes of the rows that the update rounds take their
  // pair distances from (l2 and cosine; checks.h, check_pair_codes; torch_grnnd/codes.py, pair_codes).
  m.def(
      "build(Tensor data, *, int degree=48, int initial_degree=16, int pool_size=48, int outer_iters=8, "
      "int inner_iters=8, float reverse_ratio=0.6, str update_order=\"descending\", str metric=\"l2\", "
      "int seed=0, float delta=0.02, str start=\"hubs\", Tensor? init=None, int init_split=0, "
      "str init_mode=\"merge\", Tensor? pair_code_rows=None, float pair_code_scale=0., bool widen=True) -> Tensor");
  // Batched greedy graph search; list_size=0 means max(k, 64). No argument is keyword-only:
  // torch.library.register_autograd (torch_grnnd/autograd.py) rejects keyword-only tensors
  // such as `filter`; the Python wrapper keeps them keyword-only for callers.
  // searches=0: the backend decides how many independent searches answer each query (params.h);
  // search_width=0: likewise how many parents each iteration expands (resolve_search_width).
  // codes, code_grid: the rows' compact codes (codes.h; torch_grnnd.encode), int8 or int4 as the
  // grid's shape says: the traversal computes its distances from them and the final list is
  // re-ranked by exact distances to the rows.
  m.def(
      "search(Tensor data, Tensor graph, Tensor queries, int k, int list_size=0, int search_width=0, "
      "int max_iters=0, str metric=\"l2\", int seed=0, Tensor? filter=None, int searches=0, int hub_entries=-1, "
      "Tensor? codes=None, Tensor? code_grid=None) -> (Tensor, Tensor)");
  // The same search, returning how many distances each query computed (int32 [Q]) instead of
  // its results: the work behind a recall/throughput point, for benchmarks.
  m.def(
      "search_distance_counts(Tensor data, Tensor graph, Tensor queries, int k, int list_size=0, "
      "int search_width=0, int max_iters=0, str metric=\"l2\", int seed=0, Tensor? filter=None, "
      "int searches=0, int hub_entries=-1, Tensor? codes=None, Tensor? code_grid=None) -> Tensor");
  // Exact k nearest neighbours.
  m.def("knn(Tensor data, Tensor queries, int k, *, str metric=\"l2\") -> (Tensor, Tensor)");
  // Exact k nearest neighbours of each row of y among the rows of its own example of x (examples
  // back to back: example b of x is rows ptr_x[b] .. ptr_x[b + 1], row i of y is in example
  // batch_y[i]); squared l2, -1 / +inf padded where an example has fewer than k rows. method:
  // "scan" visits every row of the example, "grid" the cells around the query (grid.h), "auto"
  // takes the grid where measured faster; all return the same. x's examples may come instead as
  // batch_x, x's example index per row, ascending (PyG's form; ptr_x None), with `examples`
  // (-1: read from batch_x, a host synchronisation): the CUDA scan then needs no ptr at all.
  m.def(
      "knn_segments(Tensor x, Tensor y, Tensor? ptr_x, Tensor batch_y, int k, str method=\"auto\", *, "
      "Tensor? batch_x=None, int examples=-1) -> (Tensor, Tensor)");
  // knn_segments' results (dists, ids [queries, k]) as an int64 edge index [2, E]: (query, id)
  // for each entry with id >= 0, dist < max_distance when given, and id != query when drop_self,
  // at most the first `most` such entries of each row when most >= 0, in row-major order;
  // neighbour_first puts the ids in row 0 (PyG's flow="source_to_target").
  m.def(
      "segment_edges(Tensor dists, Tensor ids, *, float? max_distance=None, bool drop_self=False, "
      "bool neighbour_first=False, int most=-1) -> Tensor");
  // The build's relative-neighbourhood rule applied to chosen rows (csrc/build/prune.h): for each
  // vertices[i], a row of at most `degree` of its candidates[i] (-1 padded, any values; those
  // outside [0, n) are ignored), as editing an index needs; the first `fixed` columns are kept
  // whatever the rule says and however far (the nearest `degree` of them); with `shrink`, the
  // first `degree` columns are a graph row (ascending by distance) and the others its newcomers,
  // and they lose only their surplus.
  // int32 [m, degree].
  m.def(
      "prune_rows(Tensor data, Tensor vertices, Tensor candidates, int degree, *, str metric=\"l2\", "
      "bool rule=True, int fixed=0, bool shrink=False) -> Tensor");
  // The rows data[ids] on ids' device (int64 ids in [0, n)). On a GPU, data may sit in pinned host
  // memory: a kernel reads the rows through unified addressing, so an out-of-core build copies
  // in only the rows it names, without gathering them on the host first.
  m.def("gather_rows(Tensor data, Tensor ids) -> Tensor");
  // graph (as build returns it, rows ascending by distance) with every vertex made reachable from
  // the search's entry points, as the build's last step does (csrc/build/reachability.h).
  m.def("connect(Tensor data, Tensor graph, *, str metric=\"l2\") -> Tensor");
  // graph with its short rows filled to the full degree from two hops, as the build's step
  // before that repair does (csrc/build/fill.h).
  m.def("fill(Tensor data, Tensor graph, *, str metric=\"l2\") -> Tensor");
  // The share of their dimensions that data's rows' neighbourhoods spread over, as a widening build
  // measures it to size its pools (csrc/build/build_schedule.h, neighbourhood_dimensions).
  m.def("neighbourhood_dimensions(Tensor data, *, str metric=\"l2\") -> float");
  // The hubs of data's rows (csrc/build/hubs.h): int64 ids, empty for small data.
  m.def("hub_ids(Tensor data) -> Tensor");
  // For each query, the ids of its k nearest hubs among data's rows, nearest first: int64
  // [q, min(k, hubs)] (no columns for data without hubs). The search's entry points (hubs.h).
  m.def("nearest_hubs(Tensor data, Tensor queries, int k, str metric=\"l2\") -> Tensor");
  // k nearest neighbours of every row of data among the other rows.
  m.def(
      "knn_graph(Tensor data, int k, *, str metric=\"l2\", bool exact=False, int list_size=0, int seed=0) "
      "-> (Tensor, Tensor)");
}

