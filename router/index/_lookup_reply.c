/* router.index._lookup_reply: lookup.lua's reply read into matches, in C.

   The reply is one section per group asked, in the order asked (lookup.lua says how the
   script builds them; all integers big-endian):
   - 'R' (a group without a directory): one 40-byte record per member: uint32 blocks
     matched, uint32 blocks per tier (DEVICE, HOST, DISK, REMOTE), the incarnation in 20
     ASCII digits;
   - 'D' (a group with a directory): the server's clock (a double, microseconds); one
     31-byte roster record per member ('>HdB': member index, lease deadline, search tier;
     then the incarnation), all zeros for a member not in the roster; the ends (uint32
     count, then each: uint32 position p, uint16 length and the bit set at p, uint16
     length and the bit set at p + 1); the walked members (uint32 count, then each:
     uint32 place in the group and its 20-byte record before the incarnation).
     A searched member ends at the end where its bit is set at p and clear at p + 1;
     one whose bit is in no end holds not even the first key.
   At a thousand workers a lookup's reply is a thousand records, and reading them in
   Python took about 1.5 ms of the router's time a request, more than the rest of a
   decision; here it takes about 0.2 ms. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_match.h"

#define RECORD_BYTES 40
#define TIERS 4
#define INCARNATION_DIGITS 20
#define MEMBER_HEADER 11 /* '>HdB' */
#define MEMBER_BYTES (MEMBER_HEADER + INCARNATION_DIGITS)
#define MATCH_BYTES (4 * (TIERS + 1)) /* a record before its incarnation */

/* A cursor over the reply: every read is checked against its end. */
typedef struct {
    const unsigned char *at, *end;
} Reader;

static const unsigned char *take(Reader *reader, Py_ssize_t bytes) {
    if (bytes < 0 || reader->end - reader->at < bytes) {
        PyErr_SetString(PyExc_ValueError, "a lookup reply ends within a section");
        return NULL;
    }
    const unsigned char *taken = reader->at;
    reader->at += bytes;
    return taken;
}

static Py_ssize_t read_u16(const unsigned char *at) { return (Py_ssize_t)at[0] << 8 | at[1]; }

static uint32_t read_u32(const unsigned char *at) {
    return (uint32_t)at[0] << 24 | (uint32_t)at[1] << 16 | (uint32_t)at[2] << 8 | at[3];
}

static double read_double(const unsigned char *at) {
    uint64_t bits = 0;
    for (int i = 0; i < 8; i++) bits = bits << 8 | at[i];
    double value;
    memcpy(&value, &bits, sizeof value);
    return value;
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

typedef struct {
    PyObject *out;
    PyTypeObject *match_type;
    PyObject *by_tier_of;
} Matches;

/* out[worker id] = the match; 0, or -1 with an exception set. */
static int add_match(Matches *matches, PyObject *worker_id, const unsigned char *digits,
                     uint32_t blocks, const int32_t *by_tier) {
    PyObject *incarnation = read_incarnation(digits);
    if (incarnation == NULL) return -1;
    /* Held: setting an item may run Python code (a key's __eq__) that changes the list. */
    Py_INCREF(worker_id);
    PyObject *match = new_match(matches->match_type, matches->by_tier_of, worker_id,
                                incarnation, (Py_ssize_t)blocks, by_tier, TIERS);
    Py_DECREF(incarnation);
    int failed = match == NULL || PyDict_SetItem(matches->out, worker_id, match) < 0;
    Py_XDECREF(match);
    Py_DECREF(worker_id);
    return failed ? -1 : 0;
}

/* A record's match (blocks, then blocks per tier) read; -1 with ValueError if a count is
   out of range. */
static int read_counts(const unsigned char *record, uint32_t *blocks, int32_t *by_tier) {
    *blocks = read_u32(record);
    for (int tier = 0; tier < TIERS; tier++) {
        uint32_t held = read_u32(record + 4 * (tier + 1));
        if (held > INT32_MAX) {
            PyErr_SetString(PyExc_ValueError, "a lookup record's tier count is out of range");
            return -1;
        }
        by_tier[tier] = (int32_t)held;
    }
    return 0;
}

/* The worker id at `w` of `members`, or NULL with RuntimeError if the list changed size. */
static PyObject *member_id(PyObject *members, Py_ssize_t count, Py_ssize_t w) {
    if (PyList_GET_SIZE(members) != count) {
        PyErr_SetString(PyExc_RuntimeError, "the worker ids changed during read_matches()");
        return NULL;
    }
    return PyList_GET_ITEM(members, w);
}

static int read_records_section(Reader *reader, PyObject *members, Matches *matches) {
    Py_ssize_t count = PyList_GET_SIZE(members);
    const unsigned char *records = take(reader, count * RECORD_BYTES);
    if (records == NULL) return -1;
    for (Py_ssize_t w = 0; w < count; w++) {
        const unsigned char *record = records + w * RECORD_BYTES;
        uint32_t blocks;
        int32_t by_tier[TIERS];
        if (read_counts(record, &blocks, by_tier) < 0) return -1;
        if (blocks == 0) continue;
        PyObject *worker_id = member_id(members, count, w);
        if (worker_id == NULL || add_match(matches, worker_id, record + MATCH_BYTES, blocks, by_tier) < 0)
            return -1;
    }
    return 0;
}

/* ends[index] = the lowest position where member `index`'s bit is set in `held` and
   clear in `after`, for the indexes below `indexes`. */
static void mark_ends(uint32_t *ends, Py_ssize_t indexes, uint32_t position,
                      const unsigned char *held, Py_ssize_t held_bytes,
                      const unsigned char *after, Py_ssize_t after_bytes) {
    Py_ssize_t bytes = held_bytes < (indexes + 7) / 8 ? held_bytes : (indexes + 7) / 8;
    for (Py_ssize_t b = 0; b < bytes; b++) {
        unsigned ending = held[b] & ~(b < after_bytes ? after[b] : 0) & 0xff;
        while (ending) {
            int bit = __builtin_ctz(ending);
            ending &= ending - 1;
            Py_ssize_t index = b * 8 + bit;
            if (index < indexes && (ends[index] == 0 || position < ends[index]))
                ends[index] = position;
        }
    }
}

static int read_directory_section(Reader *reader, PyObject *members, Matches *matches) {
    Py_ssize_t count = PyList_GET_SIZE(members);
    const unsigned char *clock = take(reader, 8);
    const unsigned char *records = clock ? take(reader, count * MEMBER_BYTES) : NULL;
    const unsigned char *end_count = records ? take(reader, 4) : NULL;
    if (end_count == NULL) return -1;
    double now = read_double(clock);
    /* The indexes of the live searched members: the only ends worth marking. */
    Py_ssize_t indexes = 0;
    for (Py_ssize_t w = 0; w < count; w++) {
        const unsigned char *record = records + w * MEMBER_BYTES;
        Py_ssize_t index = read_u16(record);
        if (record[MEMBER_HEADER - 1] != 0 && read_double(record + 2) > now && index >= indexes)
            indexes = index + 1;
    }
    uint32_t *ends = calloc(indexes ? (size_t)indexes : 1, sizeof *ends);
    const unsigned char **walked = calloc(count ? (size_t)count : 1, sizeof *walked);
    int result = -1;
    if (ends == NULL || walked == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (uint32_t e = 0, ends_read = read_u32(end_count); e < ends_read; e++) {
        const unsigned char *head = take(reader, 6);
        if (head == NULL) goto done;
        Py_ssize_t held_bytes = read_u16(head + 4);
        const unsigned char *held = take(reader, held_bytes);
        const unsigned char *after_length = held ? take(reader, 2) : NULL;
        if (after_length == NULL) goto done;
        Py_ssize_t after_bytes = read_u16(after_length);
        const unsigned char *after = take(reader, after_bytes);
        if (after == NULL) goto done;
        uint32_t position = read_u32(head);
        if (position == 0) {
            PyErr_SetString(PyExc_ValueError, "a lookup reply names an end at position 0");
            goto done;
        }
        mark_ends(ends, indexes, position, held, held_bytes, after, after_bytes);
    }
    const unsigned char *walked_count = take(reader, 4);
    if (walked_count == NULL) goto done;
    for (uint32_t v = 0, walked_read = read_u32(walked_count); v < walked_read; v++) {
        const unsigned char *entry = take(reader, 4 + MATCH_BYTES);
        if (entry == NULL) goto done;
        uint32_t place = read_u32(entry);
        if (place >= (uint64_t)count) {
            PyErr_SetString(PyExc_ValueError, "a lookup reply walks a member it was not asked");
            goto done;
        }
        walked[place] = entry + 4;
    }
    for (Py_ssize_t w = 0; w < count; w++) {
        const unsigned char *record = records + w * MEMBER_BYTES;
        if (!(read_double(record + 2) > now)) continue; /* not a member, or its lease ran out */
        unsigned search_tier = record[MEMBER_HEADER - 1];
        uint32_t blocks = 0;
        int32_t by_tier[TIERS] = {0};
        if (search_tier == 0) {
            if (walked[w] == NULL) continue; /* holds not even the first key */
            if (read_counts(walked[w], &blocks, by_tier) < 0) goto done;
        } else if (search_tier <= TIERS) {
            Py_ssize_t index = read_u16(record);
            blocks = index < indexes ? ends[index] : 0; /* always below: counted above */
            if (blocks > INT32_MAX) {
                PyErr_SetString(PyExc_ValueError, "a lookup reply's end is out of range");
                goto done;
            }
            by_tier[search_tier - 1] = (int32_t)blocks;
        } else {
            PyErr_SetString(PyExc_ValueError, "a roster record names no tier");
            goto done;
        }
        if (blocks == 0) continue;
        PyObject *worker_id = member_id(members, count, w);
        if (worker_id == NULL ||
            add_match(matches, worker_id, record + MEMBER_HEADER, blocks, by_tier) < 0)
            goto done;
    }
    result = 0;
done:
    free(ends);
    free(walked);
    return result;
}

static PyObject *read_matches(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 5 || !PyBytes_Check(args[0]) || !PyList_Check(args[1]) || !PyDict_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError,
                        "read_matches() takes a reply (bytes), the worker ids by group (a list "
                        "of lists), the matches (a dict), the match type and by_tier");
        return NULL;
    }
    if (check_match_builders(args[3], args[4]) < 0) return NULL;
    Matches matches = {args[2], (PyTypeObject *)args[3], args[4]};
    /* Held: the reply's buffer must outlive any Python code a dict insertion runs. */
    PyObject *reply = args[0], *groups = args[1];
    Py_INCREF(reply);
    Py_INCREF(groups);
    Reader reader = {(const unsigned char *)PyBytes_AS_STRING(reply),
                     (const unsigned char *)PyBytes_AS_STRING(reply) + PyBytes_GET_SIZE(reply)};
    int failed = 0;
    for (Py_ssize_t g = 0; !failed && g < PyList_GET_SIZE(groups); g++) {
        PyObject *members = PyList_GET_ITEM(groups, g);
        if (!PyList_Check(members)) {
            PyErr_SetString(PyExc_TypeError, "read_matches() takes the worker ids by group");
            failed = 1;
            break;
        }
        Py_INCREF(members);
        const unsigned char *kind = take(&reader, 1);
        if (kind == NULL) {
            failed = 1;
        } else if (*kind == 'R') {
            failed = read_records_section(&reader, members, &matches) < 0;
        } else if (*kind == 'D') {
            failed = read_directory_section(&reader, members, &matches) < 0;
        } else {
            PyErr_Format(PyExc_ValueError, "a lookup reply's section starts with byte %d", *kind);
            failed = 1;
        }
        Py_DECREF(members);
    }
    if (!failed && reader.at != reader.end) {
        PyErr_Format(PyExc_ValueError, "a lookup reply has %zd bytes past its sections",
                     (Py_ssize_t)(reader.end - reader.at));
        failed = 1;
    }
    Py_DECREF(reply);
    Py_DECREF(groups);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"read_matches", (PyCFunction)(void (*)(void))read_matches, METH_FASTCALL,
     "read_matches(reply, groups, out, match, by_tier): out[worker id] = match(worker id, "
     "incarnation, blocks, by_tier(blocks per tier)) for each worker of each group (lists of "
     "worker ids, in the order asked) that matched a block"},
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
    if (PyModule_AddIntConstant(m, "RECORD_BYTES", RECORD_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "MEMBER_BYTES", MEMBER_BYTES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
