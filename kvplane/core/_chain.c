/* kvplane.core._chain: the block-key chain (kvplane/core/keys.py) in C.

   key[i] = XXH3_64(key[i-1] as 8 bytes little-endian || block i's tokens as u32 LE)

   A Python loop pays a few hundred nanoseconds a block for packing, slicing and the
   call; here a block costs its hash. The hash is XXH3-64 (_xxh3.h, the project's own
   from xxHash's specification), so building needs no xxHash and running no library.
   keys.py validates the arguments and hands over tokens already packed as u32 LE. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_xxh3.h"

#if PY_BIG_ENDIAN
#error "block keys are hashed from little-endian bytes; this host is big-endian"
#endif

/* Blocks up to this many bytes are hashed from a buffer on the stack. */
#define STACK_BLOCK_BYTES 4096

/* chain(parent: int, data: buffer of u32 LE tokens, block_size: int) -> list[int]
   The keys of the full blocks in data, continuing the chain after parent. */
static PyObject *chain(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "chain() takes parent, data and block_size");
        return NULL;
    }
    unsigned long long parent = PyLong_AsUnsignedLongLong(args[0]);
    if (parent == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    Py_ssize_t block_size = PyLong_AsSsize_t(args[2]);
    if (block_size == -1 && PyErr_Occurred()) return NULL;
    if (block_size < 1 || block_size > 65536) {
        PyErr_SetString(PyExc_ValueError, "block_size must be in 1..65536");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0) return NULL;

    const size_t stride = (size_t)block_size * 4;
    const Py_ssize_t blocks = view.len / (Py_ssize_t)(stride);
    PyObject *keys = PyList_New(blocks);
    unsigned char stack_buffer[8 + STACK_BLOCK_BYTES];
    unsigned char *buffer = stack_buffer;
    if (keys != NULL && stride > STACK_BLOCK_BYTES) {
        buffer = PyMem_Malloc(8 + stride);
        if (buffer == NULL) {
            Py_CLEAR(keys);
            PyErr_NoMemory();
        }
    }
    if (keys != NULL) {
        const unsigned char *tokens = view.buf;
        uint64_t previous = parent;
        for (Py_ssize_t i = 0; i < blocks; i++) {
            memcpy(buffer, &previous, 8); /* little-endian host: the key's LE bytes */
            memcpy(buffer + 8, tokens + (size_t)i * stride, stride);
            previous = kv_xxh3_64(buffer, 8 + stride);
            PyObject *key = PyLong_FromUnsignedLongLong(previous);
            if (key == NULL) {
                Py_CLEAR(keys);
                break;
            }
            PyList_SET_ITEM(keys, i, key);
        }
    }
    if (buffer != stack_buffer) PyMem_Free(buffer);
    PyBuffer_Release(&view);
    return keys;
}

/* xxh3_64(data: buffer) -> int: the hash itself, for its published test vectors. */
static PyObject *xxh3_64(PyObject *module, PyObject *data) {
    (void)module;
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0) return NULL;
    uint64_t hash = kv_xxh3_64(view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(hash);
}

static PyMethodDef methods[] = {
    {"chain", (PyCFunction)(void (*)(void))chain, METH_FASTCALL,
     "chain(parent, data, block_size) -> the keys of data's full blocks after parent"},
    {"xxh3_64", xxh3_64, METH_O, "xxh3_64(data) -> XXH3-64 of data (default secret, seed 0)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvplane.core._chain",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__chain(void) { return PyModule_Create(&module); }
