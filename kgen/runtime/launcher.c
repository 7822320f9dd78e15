/* kgen's host-side trampoline: call a kernel's C launcher with Python ints and floats.
 *
 * Every kgen CUDA launcher has the signature
 *     int kgen_launch(const long long* ints, const double* floats)
 * and reads its arguments (device, pointers, sizes, stream, then the float scalars) from
 * the two arrays in the order its family documents. `call(fnptr, *args)` sorts Python ints
 * into `ints` and floats into `floats`, in order, and returns the launcher's error code.
 * Through ctypes the same call costs ~3 us of host time; through this, ~0.2 us.
 *
 * `triton_call(function, gx, gy, gz, block, shared, stream, codes, *args)` launches a loaded
 * Triton binary (its CUfunction handle) by the driver's cuLaunchKernel, the arguments packed
 * by `codes`, one byte per kernel parameter: 'q' a 64-bit int or pointer, 'i' a 32-bit int,
 * 'f' a float32, 'd' a float64 (each taking the next Python argument), 'n' a null pointer (a
 * scratch parameter, taking none). kgen.runtime.triton_launch builds the codes from the
 * binary's PTX parameter list and launches this way only binaries that need nothing more
 * (one CTA per cluster, no programmatic-dependent or cooperative launch, no scratch
 * allocation): the launch Triton's own launcher makes for them, without its per-call Python.
 * Returns the CUresult, or -1 where it did not launch (no libcuda, no current context, bad
 * codes): the caller then takes Triton's own launcher.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>

#define KGEN_MAX_ARGS 32

typedef int (*kgen_launch_t)(const long long*, const double*);

static PyObject* call(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  if (nargs < 1 || nargs > KGEN_MAX_ARGS + 1) {
    PyErr_SetString(PyExc_TypeError, "call(fnptr, *args): between 0 and 32 arguments");
    return NULL;
  }
  kgen_launch_t fn = (kgen_launch_t)PyLong_AsVoidPtr(args[0]);
  long long ints[KGEN_MAX_ARGS];
  double floats[KGEN_MAX_ARGS];
  int ni = 0, nf = 0;
  for (Py_ssize_t k = 1; k < nargs; ++k) {
    PyObject* a = args[k];
    if (PyFloat_Check(a)) {
      floats[nf++] = PyFloat_AS_DOUBLE(a);
    } else {
      ints[ni++] = PyLong_AsLongLong(a);  /* bool and int; anything else sets an error */
    }
  }
  if (fn == NULL || PyErr_Occurred()) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "null launcher pointer");
    return NULL;
  }
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = fn(ints, floats);
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(rc);
}

typedef int (*cu_launch_t)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                           void**, void**);
typedef int (*cu_ctx_current_t)(void**);
static cu_launch_t cu_launch = NULL;
static cu_ctx_current_t cu_ctx_current = NULL;
static int cuda_state = 0; /* 0 not looked up, 1 found, -1 missing */

static int find_cuda(void) {
  if (cuda_state == 0) {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD); /* torch / Triton loaded it */
    if (lib == NULL) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib != NULL) {
      cu_launch = (cu_launch_t)dlsym(lib, "cuLaunchKernel");
      cu_ctx_current = (cu_ctx_current_t)dlsym(lib, "cuCtxGetCurrent");
    }
    cuda_state = (cu_launch != NULL && cu_ctx_current != NULL) ? 1 : -1;
  }
  return cuda_state > 0;
}

#define KGEN_MAX_PARAMS 64

typedef union {
  long long q;
  int i;
  float f;
  double d;
  void* p;
} param_t;

static PyObject* triton_call(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  if (nargs < 8 || !PyBytes_Check(args[7])) {
    PyErr_SetString(PyExc_TypeError, "triton_call(function, gx, gy, gz, block, shared, stream, codes: bytes, *args)");
    return NULL;
  }
  void* function = PyLong_AsVoidPtr(args[0]);
  unsigned grid[3], block, shared;
  for (int k = 0; k < 3; ++k) grid[k] = (unsigned)PyLong_AsUnsignedLong(args[1 + k]);
  block = (unsigned)PyLong_AsUnsignedLong(args[4]);
  shared = (unsigned)PyLong_AsUnsignedLong(args[5]);
  void* stream = PyLong_AsVoidPtr(args[6]);
  if (PyErr_Occurred()) return NULL;
  const char* codes = PyBytes_AS_STRING(args[7]);
  const Py_ssize_t n = PyBytes_GET_SIZE(args[7]);
  if (n > KGEN_MAX_PARAMS || function == NULL || !find_cuda()) return PyLong_FromLong(-1);
  param_t vals[KGEN_MAX_PARAMS];
  void* params[KGEN_MAX_PARAMS];
  Py_ssize_t a = 8;
  for (Py_ssize_t k = 0; k < n; ++k) {
    params[k] = &vals[k];
    const char c = codes[k];
    if (c == 'n') {
      vals[k].p = NULL;
      continue;
    }
    if (a >= nargs) return PyLong_FromLong(-1);
    PyObject* v = args[a++];
    if (c == 'q') {
      vals[k].q = PyLong_AsLongLong(v);
      if (vals[k].q == -1 && PyErr_Occurred()) { /* a u64 above 2**63 */
        PyErr_Clear();
        vals[k].q = (long long)PyLong_AsUnsignedLongLong(v);
      }
    } else if (c == 'i') {
      vals[k].i = (int)PyLong_AsLongLong(v);
    } else if (c == 'f') {
      vals[k].f = (float)PyFloat_AsDouble(v);
    } else if (c == 'd') {
      vals[k].d = PyFloat_AsDouble(v);
    } else {
      return PyLong_FromLong(-1);
    }
    if (PyErr_Occurred()) return NULL;
  }
  if (a != nargs) return PyLong_FromLong(-1);
  void* ctx = NULL;
  if (cu_ctx_current(&ctx) != 0 || ctx == NULL) return PyLong_FromLong(-1); /* Triton's path makes one current */
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = cu_launch(function, grid[0], grid[1], grid[2], block, 1, 1, shared, stream, params, NULL);
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(rc);
}

static PyMethodDef methods[] = {
    {"call", (PyCFunction)(void (*)(void))call, METH_FASTCALL, "call(fnptr, *args) -> int"},
    {"triton_call", (PyCFunction)(void (*)(void))triton_call, METH_FASTCALL,
     "triton_call(function, gx, gy, gz, block, shared, stream, codes, *args) -> CUresult, or -1: not launched"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kgen_launcher", NULL, -1, methods};

PyMODINIT_FUNC PyInit_kgen_launcher(void) { return PyModule_Create(&module); }
