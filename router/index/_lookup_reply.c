/* router.index._lookup_reply: lookup.lua's reply read into matches, in C.

   The reply is one 40-byte record per worker asked, in the order asked: big-endian
   uint32 blocks matched, then uint32 blocks per tier (DEVICE, HOST, DISK, REMOTE), then
   the incarnation in 20 ASCII digits. At a thousand workers a lookup's reply is a
   thousand records, and reading them in Python took about 1.5 ms of the router's time a
   request, more than the rest of a decision; here it takes about 0.2 ms. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "_match.h"

#define RECORD_BYTES 40
#define TIERS 4
#define INCARNATION_DIGITS 20

static uint32_t read_u32(const unsigned char *at) {
    return (uint32_t)at[0] << 24 | (uint32_t)at[1] << 16 | (uint32_t)at[2] << 8 | at[3];
}

/* The record's incarnation, or NULL with ValueError (not digits, or past 2^64 - 1). */
static PyObject *read_incarnation(const unsigned char *digits) {
    uint64_t value = 0;
    for (int i = 0; i < INCARNATION_DIGITS; i++) {
        unsigned digit = digits[i] - '0';
        if (digit > 9 || value > (UINT64_MAX - digit) / 10) {
            PyErr_SetString(PyExc_ValueError, "a lookup record's incarnation is not a uint64");
            return NULL;
        }
        value = value * 10 + digit;
    }
    return PyLong_FromUnsignedLongLong(value);
}

static PyObject *read_matches(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 5 || !PyBytes_Check(args[0]) || !PyList_Check(args[1]) || !PyDict_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError,
                        "read_matches() takes a reply (bytes), worker ids (a list), the matches "
                        "(a dict), the match type and by_tier");
        return NULL;
    }
    if (check_match_builders(args[3], args[4]) < 0) return NULL;
    PyObject *worker_ids = args[1], *out = args[2];
    const unsigned char *records = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    Py_ssize_t count = PyList_GET_SIZE(worker_ids);
    if (PyBytes_GET_SIZE(args[0]) != count * RECORD_BYTES) {
        PyErr_Format(PyExc_ValueError, "a lookup reply of %zd bytes for %zd workers",
                     PyBytes_GET_SIZE(args[0]), count);
        return NULL;
    }
    for (Py_ssize_t w = 0; w < count; w++) {
        if (PyList_GET_SIZE(worker_ids) != count) {
            PyErr_SetString(PyExc_RuntimeError, "the worker ids changed during read_matches()");
            return NULL;
        }
        const unsigned char *record = records + w * RECORD_BYTES;
        uint32_t blocks = read_u32(record);
        if (blocks == 0) continue;
        int32_t by_tier[TIERS];
        for (int tier = 0; tier < TIERS; tier++) {
            uint32_t held = read_u32(record + 4 * (tier + 1));
            if (held > INT32_MAX) {
                PyErr_SetString(PyExc_ValueError, "a lookup record's tier count is out of range");
                return NULL;
            }
            by_tier[tier] = (int32_t)held;
        }
        PyObject *incarnation = read_incarnation(record + 4 * (TIERS + 1));
        if (incarnation == NULL) return NULL;
        /* Held: setting an item may run Python code (a key's __eq__) that changes the list. */
        PyObject *worker_id = PyList_GET_ITEM(worker_ids, w);
        Py_INCREF(worker_id);
        PyObject *match = new_match((PyTypeObject *)args[3], args[4], worker_id, incarnation,
                                    (Py_ssize_t)blocks, by_tier, TIERS);
        Py_DECREF(incarnation);
        int failed = match == NULL || PyDict_SetItem(out, worker_id, match) < 0;
        Py_XDECREF(match);
        Py_DECREF(worker_id);
        if (failed) return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"read_matches", (PyCFunction)(void (*)(void))read_matches, METH_FASTCALL,
     "read_matches(reply, worker_ids, out, match, by_tier): out[worker id] = match(worker id, "
     "incarnation, blocks, by_tier(blocks per tier)) for each worker whose record matched"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "router.index._lookup_reply",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__lookup_reply(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "RECORD_BYTES", RECORD_BYTES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
