#include <Python.h>

#include "progress.h"

#include <string>

#include <c10/util/Exception.h>

namespace grnnd {
namespace {

// Per thread, because an op runs on the thread that called it: two threads building at once
// each see their own callback. Owned reference; only touched with the GIL held, except for
// the null check.
thread_local PyObject* progress_callback = nullptr;

// "KeyboardInterrupt" or "ValueError: message" for the error that stops the build.
std::string describe_python_error() {
  PyObject *type = nullptr, *value = nullptr, *traceback = nullptr;
  PyErr_Fetch(&type, &value, &traceback);
  PyErr_NormalizeException(&type, &value, &traceback);
  std::string text = type != nullptr ? reinterpret_cast<PyTypeObject*>(type)->tp_name : "unknown error";
  if (value != nullptr) {
    if (PyObject* message = PyObject_Str(value)) {
      const char* utf8 = PyUnicode_AsUTF8(message);
      if (utf8 != nullptr && *utf8 != '\0') text += std::string(": ") + utf8;
      Py_DECREF(message);
    }
    PyErr_Clear();  // from a failed str(): the original error is what gets reported
  }
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(traceback);
  return text;
}

}  // namespace

bool progress_requested() { return progress_callback != nullptr; }

void report_progress(int64_t done, int64_t total, int64_t changes, double unfound) {
  if (progress_callback == nullptr) return;
  const PyGILState_STATE gil = PyGILState_Ensure();
  // The callback may replace itself; hold our own reference for the call.
  PyObject* callback = progress_callback;
  Py_INCREF(callback);
  PyObject* result = PyObject_CallFunction(callback, "LLLd", static_cast<long long>(done), static_cast<long long>(total),
                                           static_cast<long long>(changes), unfound);
  Py_DECREF(callback);
  std::string error;
  if (result == nullptr) {
    error = describe_python_error();
  } else {
    Py_DECREF(result);
  }
  PyGILState_Release(gil);
  TORCH_CHECK(error.empty(), "build: stopped by the progress callback, which raised ", error);
}

PyObject* set_progress_callback(PyObject* /*module*/, PyObject* callback) {
  if (callback != Py_None && !PyCallable_Check(callback)) {
    PyErr_SetString(PyExc_TypeError, "_set_progress_callback: expected a callable or None");
    return nullptr;
  }
  PyObject* previous = progress_callback;
  progress_callback = callback == Py_None ? nullptr : callback;
  Py_XINCREF(progress_callback);
  Py_XDECREF(previous);
  Py_RETURN_NONE;
}

}  // namespace grnnd
