// Progress of long builds, reported to Python after every update round.
//
// Python installs a callback for the calling thread (torch_grnnd/progress.py, through
// torch_grnnd._C._set_progress_callback); the build kernels call report_progress after each
// update round. Without a callback both functions cost one thread-local read, so the kernels
// call them unconditionally. This header has no Python types: the CUDA sources include it.
#pragma once

#include <cstdint>

namespace grnnd {

// Whether the calling thread has a callback installed. The CUDA build checks it before paying
// for the stream synchronisation that makes a report true.
bool progress_requested();

// Calls the callback with (done, total, changes, unfound): rounds done, the most the build may
// run (less once it has converged: the last report has done == total), the pool entries the
// last round changed, and the share of a sample of rows that a search of the graph so far did
// not find at the last measure (build_schedule.h, unfound_share; -1 before it is measured).
// Takes the GIL for the call (ops run without it).
// An exception raised by the callback stops the build: it is rethrown as a c10::Error, and
// the Python side re-raises the original exception (so Ctrl-C during a build cancels it).
void report_progress(int64_t done, int64_t total, int64_t changes, double unfound = -1);

}  // namespace grnnd

// The Python binding, registered on torch_grnnd._C in grnnd.cpp (only units that include
// Python.h see it).
#ifdef Py_PYTHON_H
namespace grnnd {
// _set_progress_callback(callable or None): installs (or removes) the calling thread's callback.
PyObject* set_progress_callback(PyObject* module, PyObject* callback);
}  // namespace grnnd
#endif
