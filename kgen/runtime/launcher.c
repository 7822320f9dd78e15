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
 *
 * `replay_plan(n_slots, n_values, steps)` keeps a group of such launches (a Replay's) packed
 * once, and `replay_run(plan, stream, values)` launches them all with the slots' new
 * addresses and the scalars' new values patched in: the template copy, the patching and the
 * argument tuple that a Python replay builds per launch (~2-3 us of a call) happen here.
 * `replay_go(plan, stream, *values)` is replay_run with the values as arguments and, for a
 * plan made with guards (`replay_plan(..., guards)`: (dict, name, object) triples, a kernel's
 * global constants as Triton compiled it), the checks a replay makes before it launches:
 * every guarded name still bound to its object, and the plan's CUDA context current; -4
 * (nothing launched) where one is not, and the caller's own checks decide.
 * `replay_args(plan, step, values)` returns the parameters one step would be launched with
 * (tests compare them with the Python replay's).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <string.h>

/* the most arguments a launcher takes: fused_mlp's TMA ring at 8 layers with every bias, 33 */
#define KGEN_MAX_ARGS 40

typedef int (*kgen_launch_t)(const long long*, const double*);

static PyObject* call(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  if (nargs < 1 || nargs > KGEN_MAX_ARGS + 1) {
    PyErr_SetString(PyExc_TypeError, "call(fnptr, *args): between 0 and 40 arguments");
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

/* One value by its code into `out`; 0, or -1 with a Python error set. */
static int pack(char code, PyObject* v, param_t* out) {
  if (code == 'q') {
    out->q = PyLong_AsLongLong(v);
    if (out->q == -1 && PyErr_Occurred()) { /* a u64 above 2**63 */
      PyErr_Clear();
      out->q = (long long)PyLong_AsUnsignedLongLong(v);
    }
  } else if (code == 'i') {
    out->i = (int)PyLong_AsLongLong(v);
  } else if (code == 'f') {
    out->f = (float)PyFloat_AsDouble(v);
  } else if (code == 'd') {
    out->d = PyFloat_AsDouble(v);
  } else {
    PyErr_Format(PyExc_ValueError, "parameter code %c takes no value", code);
    return -1;
  }
  return PyErr_Occurred() ? -1 : 0;
}

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
    if (a >= nargs || (c != 'q' && c != 'i' && c != 'f' && c != 'd')) return PyLong_FromLong(-1);
    if (pack(c, args[a++], &vals[k])) return NULL;
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

/* ---- replay plans ---- */

#define KGEN_MAX_STEPS 16
#define KGEN_NOT_LAUNCHED (-1)
#define KGEN_MISALIGNED (-2)
#define KGEN_STALE (-4) /* a guard failed: the caller's own checks decide (nothing launched) */

typedef struct {
  void* function;
  unsigned grid[3], block, shared;
  int n;                                        /* parameters */
  char codes[KGEN_MAX_PARAMS];
  param_t vals[KGEN_MAX_PARAMS];                /* as recorded; patched and moved ones replaced per call */
  int npatch, patch_k[KGEN_MAX_PARAMS], patch_slot[KGEN_MAX_PARAMS];
  long long patch_off[KGEN_MAX_PARAMS];
  int nmove, move_k[KGEN_MAX_PARAMS], move_value[KGEN_MAX_PARAMS];
} rstep_t;

typedef struct {
  int nslots, nvalues, nsteps;
  PyObject* guards; /* a tuple of (dict, name, object) triples, or NULL: replay_go checks none */
  void* ctx;        /* with guards: the CUDA context current when planned (NULL: none then) */
  rstep_t steps[KGEN_MAX_STEPS];
} rplan_t;

static const char* PLAN_NAME = "kgen.replay_plan";

static void plan_free(PyObject* capsule) {
  rplan_t* p = PyCapsule_GetPointer(capsule, PLAN_NAME);
  if (p != NULL) Py_XDECREF(p->guards);
  PyMem_Free(p);
}

static int int_item(PyObject* seq, Py_ssize_t i, long long* out) {
  PyObject* v = PySequence_GetItem(seq, i);
  if (v == NULL) return -1;
  *out = PyLong_AsLongLong(v);
  Py_DECREF(v);
  return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* steps: (function, gx, gy, gz, block, shared, codes, template, patches, moved) each, where
   `template` holds one value per argument (codes other than 'n', in order; None where a
   patch or a move fills it), `patches` (argument, slot, byte offset) and `moved` (argument,
   value index) */
static int plan_step(rstep_t* s, PyObject* t, int nslots, int nvalues) {
  if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 10 || !PyBytes_Check(PyTuple_GET_ITEM(t, 6))) {
    PyErr_SetString(PyExc_TypeError, "a step is (function, gx, gy, gz, block, shared, codes: bytes, template, patches, moved)");
    return -1;
  }
  s->function = PyLong_AsVoidPtr(PyTuple_GET_ITEM(t, 0));
  for (int k = 0; k < 3; ++k) s->grid[k] = (unsigned)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(t, 1 + k));
  s->block = (unsigned)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(t, 4));
  s->shared = (unsigned)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(t, 5));
  if (PyErr_Occurred()) return -1;
  if (s->function == NULL) {
    PyErr_SetString(PyExc_ValueError, "null function");
    return -1;
  }
  PyObject* codes = PyTuple_GET_ITEM(t, 6);
  s->n = (int)PyBytes_GET_SIZE(codes);
  if (s->n > KGEN_MAX_PARAMS) {
    PyErr_SetString(PyExc_ValueError, "too many parameters");
    return -1;
  }
  memcpy(s->codes, PyBytes_AS_STRING(codes), s->n);
  int arg_param[KGEN_MAX_PARAMS], nargs = 0; /* argument j -> parameter k */
  for (int k = 0; k < s->n; ++k) {
    if (s->codes[k] == 'n') {
      s->vals[k].p = NULL;
    } else {
      arg_param[nargs++] = k;
    }
  }
  PyObject* template = PyTuple_GET_ITEM(t, 7);
  PyObject* patches = PyTuple_GET_ITEM(t, 8);
  PyObject* moved = PyTuple_GET_ITEM(t, 9);
  Py_ssize_t nt = PySequence_Size(template), np = PySequence_Size(patches), nm = PySequence_Size(moved);
  if (nt < 0 || np < 0 || nm < 0) return -1;
  if (nt != nargs || np > nargs || nm > nargs) {
    PyErr_SetString(PyExc_ValueError, "the template, patches or moved values do not fit the codes");
    return -1;
  }
  char filled[KGEN_MAX_PARAMS] = {0};
  s->npatch = (int)np;
  for (Py_ssize_t i = 0; i < np; ++i) {
    PyObject* e = PySequence_GetItem(patches, i);
    if (e == NULL) return -1;
    long long j, slot, off;
    int bad = int_item(e, 0, &j) || int_item(e, 1, &slot) || int_item(e, 2, &off);
    Py_DECREF(e);
    if (bad) return -1;
    if (j < 0 || j >= nargs || slot < 0 || slot >= nslots || s->codes[arg_param[j]] != 'q') {
      PyErr_SetString(PyExc_ValueError, "a patch names no pointer parameter or no slot");
      return -1;
    }
    s->patch_k[i] = arg_param[j], s->patch_slot[i] = (int)slot, s->patch_off[i] = off;
    filled[j] = 1;
  }
  s->nmove = (int)nm;
  for (Py_ssize_t i = 0; i < nm; ++i) {
    PyObject* e = PySequence_GetItem(moved, i);
    if (e == NULL) return -1;
    long long j, vi;
    int bad = int_item(e, 0, &j) || int_item(e, 1, &vi);
    Py_DECREF(e);
    if (bad) return -1;
    if (j < 0 || j >= nargs || vi < nslots || vi >= nvalues) {
      PyErr_SetString(PyExc_ValueError, "a moved value names no parameter or no scalar");
      return -1;
    }
    s->move_k[i] = arg_param[j], s->move_value[i] = (int)vi;
    filled[j] = 1;
  }
  for (int j = 0; j < nargs; ++j) {
    PyObject* v = PySequence_GetItem(template, j);
    if (v == NULL) return -1;
    int rc = 0;
    if (v == Py_None) {
      if (!filled[j]) {
        PyErr_SetString(PyExc_ValueError, "a parameter with no value");
        rc = -1;
      } else {
        s->vals[arg_param[j]].q = 0;
      }
    } else {
      rc = pack(s->codes[arg_param[j]], v, &s->vals[arg_param[j]]);
    }
    Py_DECREF(v);
    if (rc) return -1;
  }
  return 0;
}

static PyObject* replay_plan(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 3 && nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "replay_plan(n_slots, n_values, steps[, guards])");
    return NULL;
  }
  PyObject* guards = nargs == 4 ? args[3] : NULL;
  if (guards != NULL) {
    int ok = PyTuple_Check(guards);
    for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(guards); ++i) {
      PyObject* g = PyTuple_GET_ITEM(guards, i);
      ok = PyTuple_Check(g) && PyTuple_GET_SIZE(g) == 3 && PyDict_Check(PyTuple_GET_ITEM(g, 0));
    }
    if (!ok) {
      PyErr_SetString(PyExc_TypeError, "guards: a tuple of (dict, name, object)");
      return NULL;
    }
  }
  long nslots = PyLong_AsLong(args[0]), nvalues = PyLong_AsLong(args[1]);
  if (PyErr_Occurred()) return NULL;
  PyObject* steps = PySequence_Fast(args[2], "steps: a sequence");
  if (steps == NULL) return NULL;
  Py_ssize_t ns = PySequence_Fast_GET_SIZE(steps);
  if (ns < 1 || ns > KGEN_MAX_STEPS || nslots < 0 || nvalues < nslots || nvalues > KGEN_MAX_PARAMS * KGEN_MAX_STEPS) {
    Py_DECREF(steps);
    PyErr_SetString(PyExc_ValueError, "replay_plan: 1 to 16 steps, n_slots <= n_values");
    return NULL;
  }
  rplan_t* p = PyMem_Calloc(1, sizeof(rplan_t));
  if (p == NULL) {
    Py_DECREF(steps);
    return PyErr_NoMemory();
  }
  p->nslots = (int)nslots, p->nvalues = (int)nvalues, p->nsteps = (int)ns;
  if (guards != NULL) {
    if (find_cuda() && cu_ctx_current(&p->ctx) != 0) p->ctx = NULL;
    p->guards = Py_NewRef(guards);
  }
  for (Py_ssize_t i = 0; i < ns; ++i) {
    if (plan_step(&p->steps[i], PySequence_Fast_GET_ITEM(steps, i), p->nslots, p->nvalues)) {
      Py_DECREF(steps);
      Py_XDECREF(p->guards);
      PyMem_Free(p);
      return NULL;
    }
  }
  Py_DECREF(steps);
  PyObject* capsule = PyCapsule_New(p, PLAN_NAME, plan_free);
  if (capsule == NULL) {
    Py_XDECREF(p->guards);
    PyMem_Free(p);
  }
  return capsule;
}

/* Every step's parameters for the values `items[0..n)` into vals[step]; 0, KGEN_MISALIGNED
   (a slot address not 16-byte aligned), or -3 with a Python error set. Nothing is launched. */
static int fill(const rplan_t* p, PyObject* const* items, Py_ssize_t n, param_t (*vals)[KGEN_MAX_PARAMS]) {
  if (n < p->nvalues) {
    PyErr_SetString(PyExc_ValueError, "values: fewer than the plan's slots and scalars");
    return -3;
  }
  long long slot[KGEN_MAX_PARAMS * KGEN_MAX_STEPS];
  long long bad = 0;
  for (int i = 0; i < p->nslots; ++i) {
    slot[i] = PyLong_AsLongLong(items[i]);
    if (slot[i] == -1 && PyErr_Occurred()) return -3;
    bad |= slot[i];
  }
  if (bad & 15) return KGEN_MISALIGNED;
  for (int k = 0; k < p->nsteps; ++k) {
    const rstep_t* s = &p->steps[k];
    memcpy(vals[k], s->vals, s->n * sizeof(param_t));
    for (int i = 0; i < s->npatch; ++i) vals[k][s->patch_k[i]].q = slot[s->patch_slot[i]] + s->patch_off[i];
    for (int i = 0; i < s->nmove; ++i) {
      if (pack(s->codes[s->move_k[i]], items[s->move_value[i]], &vals[k][s->move_k[i]])) return -3;
    }
  }
  return 0;
}

/* fill from `values`, a tuple or a list. */
static int fill_seq(const rplan_t* p, PyObject* values, param_t (*vals)[KGEN_MAX_PARAMS]) {
  if (!PyTuple_Check(values) && !PyList_Check(values)) {
    PyErr_SetString(PyExc_TypeError, "values: a tuple or a list");
    return -3;
  }
  return fill(p, PySequence_Fast_ITEMS(values), PySequence_Fast_GET_SIZE(values), vals);
}

/* Every step launched on `stream` in the current context: 0 or the first CUresult. */
static int launch_all(const rplan_t* p, void* stream, param_t (*vals)[KGEN_MAX_PARAMS]) {
  int rc = 0;
  Py_BEGIN_ALLOW_THREADS
  for (int k = 0; k < p->nsteps && rc == 0; ++k) {
    const rstep_t* s = &p->steps[k];
    void* params[KGEN_MAX_PARAMS];
    for (int i = 0; i < s->n; ++i) params[i] = &vals[k][i];
    rc = cu_launch(s->function, s->grid[0], s->grid[1], s->grid[2], s->block, 1, 1, s->shared, stream, params, NULL);
  }
  Py_END_ALLOW_THREADS
  return rc;
}

/* The plan, its stream and, with `guarded`, its guards checked: KGEN_STALE where a guarded
   global is no longer bound to the object it was planned with, or another context than the
   plan's is current (the caller's own checks then decide); then the values `items[0..n)`
   patched in and every step launched. NULL with a Python error set. */
static PyObject* run(PyObject* const* args, PyObject* const* items, Py_ssize_t n, int guarded) {
  const rplan_t* p = PyCapsule_GetPointer(args[0], PLAN_NAME);
  if (p == NULL) return NULL;
  void* stream = PyLong_AsVoidPtr(args[1]);
  if (PyErr_Occurred()) return NULL;
  guarded = guarded && p->guards != NULL;
  for (Py_ssize_t i = 0; guarded && i < PyTuple_GET_SIZE(p->guards); ++i) {
    PyObject* g = PyTuple_GET_ITEM(p->guards, i);
    PyObject* now = PyDict_GetItemWithError(PyTuple_GET_ITEM(g, 0), PyTuple_GET_ITEM(g, 1));
    if (now == NULL && PyErr_Occurred()) return NULL;
    if (now != PyTuple_GET_ITEM(g, 2)) return PyLong_FromLong(KGEN_STALE);
  }
  param_t vals[KGEN_MAX_STEPS][KGEN_MAX_PARAMS];
  int rc = fill(p, items, n, vals);
  if (rc == -3) return NULL;
  if (rc != 0) return PyLong_FromLong(rc);
  if (!find_cuda()) return PyLong_FromLong(KGEN_NOT_LAUNCHED);
  void* ctx = NULL;
  if (cu_ctx_current(&ctx) != 0 || ctx == NULL) return PyLong_FromLong(KGEN_NOT_LAUNCHED);
  if (guarded && ctx != p->ctx) return PyLong_FromLong(KGEN_STALE);
  return PyLong_FromLong(launch_all(p, stream, vals));
}

/* run without the guards, the values a tuple or a list */
static PyObject* replay_run(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 3 || (!PyTuple_Check(args[2]) && !PyList_Check(args[2]))) {
    PyErr_SetString(PyExc_TypeError, "replay_run(plan, stream, values: a tuple or a list)");
    return NULL;
  }
  return run(args, PySequence_Fast_ITEMS(args[2]), PySequence_Fast_GET_SIZE(args[2]), 0);
}

/* run with the guards, the values as arguments (no list to build) */
static PyObject* replay_go(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  if (nargs < 2) {
    PyErr_SetString(PyExc_TypeError, "replay_go(plan, stream, *values)");
    return NULL;
  }
  return run(args, args + 2, nargs - 2, 1);
}

static PyObject* replay_args(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "replay_args(plan, step, values)");
    return NULL;
  }
  const rplan_t* p = PyCapsule_GetPointer(args[0], PLAN_NAME);
  if (p == NULL) return NULL;
  long step = PyLong_AsLong(args[1]);
  if (PyErr_Occurred()) return NULL;
  if (step < 0 || step >= p->nsteps) {
    PyErr_SetString(PyExc_IndexError, "no such step");
    return NULL;
  }
  param_t vals[KGEN_MAX_STEPS][KGEN_MAX_PARAMS];
  int rc = fill_seq(p, args[2], vals);
  if (rc == -3) return NULL;
  if (rc != 0) return PyLong_FromLong(rc);
  const rstep_t* s = &p->steps[step];
  PyObject* out = PyTuple_New(s->n);
  if (out == NULL) return NULL;
  for (int i = 0; i < s->n; ++i) {
    const char c = s->codes[i];
    PyObject* v = c == 'n' ? Py_NewRef(Py_None)
                  : c == 'q' ? PyLong_FromLongLong(vals[step][i].q)
                  : c == 'i' ? PyLong_FromLong(vals[step][i].i)
                  : c == 'f' ? PyFloat_FromDouble(vals[step][i].f)
                             : PyFloat_FromDouble(vals[step][i].d);
    if (v == NULL) {
      Py_DECREF(out);
      return NULL;
    }
    PyTuple_SET_ITEM(out, i, v);
  }
  return out;
}

static PyMethodDef methods[] = {
    {"call", (PyCFunction)(void (*)(void))call, METH_FASTCALL, "call(fnptr, *args) -> int"},
    {"triton_call", (PyCFunction)(void (*)(void))triton_call, METH_FASTCALL,
     "triton_call(function, gx, gy, gz, block, shared, stream, codes, *args) -> CUresult, or -1: not launched"},
    {"replay_plan", (PyCFunction)(void (*)(void))replay_plan, METH_FASTCALL,
     "replay_plan(n_slots, n_values, steps) -> plan"},
    {"replay_run", (PyCFunction)(void (*)(void))replay_run, METH_FASTCALL,
     "replay_run(plan, stream, values) -> 0, a CUresult, -1: nothing launched, -2: a slot misaligned, nothing launched"},
    {"replay_go", (PyCFunction)(void (*)(void))replay_go, METH_FASTCALL,
     "replay_go(plan, stream, *values) -> replay_run's codes, or -4: a guard failed, nothing launched"},
    {"replay_args", (PyCFunction)(void (*)(void))replay_args, METH_FASTCALL,
     "replay_args(plan, step, values) -> that step's parameters, or -2: a slot misaligned"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kgen_launcher", NULL, -1, methods};

PyMODINIT_FUNC PyInit_kgen_launcher(void) { return PyModule_Create(&module); }
