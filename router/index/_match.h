/* One lookup result, built in C by both index backends' native parts (_table.c for the
   memory index, _lookup_reply.c for Redis replies): match_type(worker id, incarnation,
   blocks, by_tier(blocks per tier as a tuple)), where match_type is a tuple subclass
   (PrefixMatch) and by_tier a callable (router/index/base.py, blocks_by_tier). */

#ifndef KVPLANE_MATCH_H
#define KVPLANE_MATCH_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* A new reference, or NULL with an exception set. Steals no reference. */
static inline PyObject *new_match(PyTypeObject *match_type, PyObject *by_tier_of,
                                  PyObject *worker_id, PyObject *incarnation, Py_ssize_t blocks,
                                  const int32_t *by_tier, int tiers) {
    PyObject *counts = PyTuple_New(tiers);
    if (counts == NULL) return NULL;
    for (int tier = 0; tier < tiers; tier++) {
        PyObject *value = PyLong_FromLong(by_tier[tier]);
        if (value == NULL) {
            Py_DECREF(counts);
            return NULL;
        }
        PyTuple_SET_ITEM(counts, tier, value);
    }
    PyObject *mapping = PyObject_CallOneArg(by_tier_of, counts);
    Py_DECREF(counts);
    PyObject *length = mapping ? PyLong_FromSsize_t(blocks) : NULL;
    /* A tuple subclass is built as tuple.__new__ builds one: allocated, then filled. */
    PyObject *result = length ? match_type->tp_alloc(match_type, 4) : NULL;
    if (result == NULL) {
        Py_XDECREF(mapping);
        Py_XDECREF(length);
        return NULL;
    }
    Py_INCREF(worker_id);
    PyTuple_SET_ITEM(result, 0, worker_id);
    Py_INCREF(incarnation);
    PyTuple_SET_ITEM(result, 1, incarnation);
    PyTuple_SET_ITEM(result, 2, length);
    PyTuple_SET_ITEM(result, 3, mapping);
    return result;
}

/* Whether `match_type` and `by_tier_of` can build matches; TypeError if not. */
static inline int check_match_builders(PyObject *match_type, PyObject *by_tier_of) {
    if (match_type == NULL || by_tier_of == NULL || !PyType_Check(match_type) ||
        !PyType_IsSubtype((PyTypeObject *)match_type, &PyTuple_Type) ||
        !PyCallable_Check(by_tier_of)) {
        PyErr_SetString(PyExc_TypeError, "match must be a tuple type and by_tier a callable");
        return -1;
    }
    return 0;
}

#endif
