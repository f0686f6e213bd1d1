/* router.index._table: the in-memory index's storage, in C (memory.py keeps the policy:
   who is alive, which slot a worker has, when to evict).

   A LocationTable maps a block key to the worker slots that hold it, each with a bit
   per tier, and to the block's depth (its position in its chain, for eviction order).

   Layout. One open-addressed array of 16-byte nodes, linear probing, at most 80% full;
   a removed node is closed up by shifting its cluster back (no tombstones). A holder
   is one uint32, slot << 8 | tier bits, so the fastest tier a worker holds a block on
   is its lowest set bit. A node with one holder keeps it inline; one with more keeps
   the number of a holder array (sorted by slot) from the table's pool of arrays.

   Why this shape. Most blocks have one holder (inline: no second memory access, and
   16 bytes a block), shared prefixes have many (one sorted array). A lookup walks the request's
   keys keeping the workers still matching, sorted by slot, and intersects them with
   each node's holders: the cost follows the holders actually met, not the fleet size.
   Nodes are found with prefetches issued some keys ahead, so the cache misses of a
   long prompt overlap instead of adding up.

   Keys come from agents: the slot of a key is a keyed mix of it (a secret seed from
   memory.py), so chosen keys cannot pile into one cluster. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#include "_match.h"

/* Node arrays this large are mapped from the kernel, not taken from the allocator: a
   table that doubles gives the old array back to the system at once, so the process
   does not keep both (the allocator would keep the freed one for later). */
#define MAPPED_BYTES (1u << 20)
#define MAX_TIERS 8
#define MAX_DEPTH 65535
#define MAX_SLOT 65534u /* so that a node's holder count fits its uint16 */
#define PREFETCH_AHEAD 16
#define RUN_STORE 0
#define RUN_REMOVE 1
#define RUN_CLEAR 2

typedef struct {
    uint64_t key;
    uint32_t holder; /* count 1: the holder; more: the number of its holder array */
    uint16_t depth;
    uint16_t count;  /* holders; 0: the node is empty */
} Node;

/* More than one holder: a sorted array, in the table's pool. */
typedef struct {
    uint32_t capacity;
    uint32_t items[];
} HolderArray;

typedef struct {
    PyObject_HEAD
    Node *nodes;
    size_t mask;           /* capacity - 1; the capacity is a power of two */
    size_t used;           /* nonempty nodes */
    uint64_t seed;
    uint64_t multiplier; /* odd, derived from the seed */
    int tiers;
    int64_t *slot_entries; /* [slot * tiers + tier]: entries held */
    size_t slots;          /* rows of slot_entries */
    int64_t entries;       /* all entries */
    HolderArray **arrays;  /* the pool: arrays in use, and free numbers */
    uint32_t *free_arrays; /* numbers of the pool not in use */
    size_t array_count, free_count, pool_capacity;
    size_t array_bytes;    /* bytes of the holder arrays */
    PyTypeObject *match_type; /* a tuple subclass: (worker id, incarnation, blocks, by tier) */
    PyObject *by_tier;        /* blocks per tier (a tuple) -> the mapping a match carries */
} Table;

static inline uint64_t mix(uint64_t key, uint64_t seed, uint64_t multiplier) {
    /* MurmurHash3's 64-bit finaliser over the key, seeded and first multiplied by a
       secret odd number: after a XOR alone, keys with a chosen difference would
       collide as often whatever the seed; the secret product scatters such pairs. Every
       key bit reaches the low bits the slot is taken from. */
    key = (key ^ seed) * multiplier;
    key ^= key >> 33;
    key *= 0xff51afd7ed558ccdULL;
    key ^= key >> 33;
    key *= 0xc4ceb9fe1a85ec53ULL;
    key ^= key >> 33;
    return key;
}

static inline uint32_t *holders_of(const Table *t, Node *node) {
    return node->count == 1 ? &node->holder : t->arrays[node->holder]->items;
}

static inline uint32_t holder_slot(uint32_t holder) { return holder >> 8; }

static inline size_t home_of(const Table *t, uint64_t key) {
    return (size_t)mix(key, t->seed, t->multiplier) & t->mask;
}

/* The node holding `key`, or the empty node ending its probe run (where it would go);
   the probe starts at its home, `at`. */
static size_t probe(const Table *t, uint64_t key, size_t at) {
    while (t->nodes[at].count && t->nodes[at].key != key) at = (at + 1) & t->mask;
    return at;
}

static Node *find(const Table *t, uint64_t key, size_t at) {
    Node *node = &t->nodes[probe(t, key, at)];
    return node->count ? node : NULL;
}

/* Index of the first holder whose slot is >= slot, in holders[from..count). */
static inline uint32_t lower_bound(const uint32_t *holders, uint32_t from, uint32_t count,
                                   uint32_t slot) {
    uint32_t lo = from, hi = count;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (holder_slot(holders[mid]) < slot)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static inline int64_t popcount8(uint32_t bits) { return __builtin_popcount(bits & 0xffu); }

/* -- table shape ------------------------------------------------------------------- */

static Node *allocate_nodes(size_t capacity) {
    size_t bytes = capacity * sizeof(Node);
    if (bytes < MAPPED_BYTES) return PyMem_Calloc(capacity, sizeof(Node));
    void *nodes = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return nodes == MAP_FAILED ? NULL : nodes; /* mapped pages read as zeros */
}

static void free_nodes(Node *nodes, size_t capacity) {
    size_t bytes = capacity * sizeof(Node);
    if (bytes < MAPPED_BYTES)
        PyMem_Free(nodes);
    else
        munmap(nodes, bytes);
}

static int allocate(Table *t, size_t capacity) {
    t->nodes = allocate_nodes(capacity);
    if (t->nodes == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->mask = capacity - 1;
    t->used = 0;
    return 0;
}

static int grow(Table *t) {
    Node *old = t->nodes;
    size_t old_capacity = t->mask + 1;
    if (allocate(t, old_capacity * 2) < 0) {
        t->nodes = old;
        t->mask = old_capacity - 1;
        return -1;
    }
    size_t used = 0;
    for (size_t i = 0; i < old_capacity; i++) {
        if (!old[i].count) continue;
        size_t at = home_of(t, old[i].key);
        while (t->nodes[at].count) at = (at + 1) & t->mask;
        t->nodes[at] = old[i]; /* the holder array moves with its node */
        used++;
    }
    t->used = used;
    free_nodes(old, old_capacity);
    return 0;
}

static int reserve_slot(Table *t, uint32_t slot) {
    if (slot < t->slots) return 0;
    size_t slots = t->slots ? t->slots : 16;
    while (slots <= slot) slots *= 2;
    int64_t *entries = PyMem_Realloc(t->slot_entries, slots * t->tiers * sizeof(int64_t));
    if (entries == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memset(entries + t->slots * t->tiers, 0, (slots - t->slots) * t->tiers * sizeof(int64_t));
    t->slot_entries = entries;
    t->slots = slots;
    return 0;
}

static void release_array(Table *t, uint32_t number) {
    t->array_bytes -= sizeof(HolderArray) + t->arrays[number]->capacity * sizeof(uint32_t);
    PyMem_Free(t->arrays[number]);
    t->arrays[number] = NULL;
    t->free_arrays[t->free_count++] = number;
}

static void free_holders(Table *t, Node *node) {
    if (node->count > 1) release_array(t, node->holder);
}

/* A number of the pool for a new array (growing the pool), or -1 with MemoryError. */
static int64_t take_array_number(Table *t) {
    if (t->free_count) return t->free_arrays[--t->free_count];
    if (t->array_count == t->pool_capacity) {
        size_t capacity = t->pool_capacity ? t->pool_capacity * 2 : 64;
        if (capacity > UINT32_MAX) {
            PyErr_NoMemory();
            return -1;
        }
        HolderArray **arrays = PyMem_Realloc(t->arrays, capacity * sizeof(HolderArray *));
        if (arrays == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        t->arrays = arrays;
        uint32_t *free_arrays = PyMem_Realloc(t->free_arrays, capacity * sizeof(uint32_t));
        if (free_arrays == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        t->free_arrays = free_arrays;
        t->pool_capacity = capacity;
    }
    return (int64_t)t->array_count++;
}

/* Empty the node at `at` and close its cluster up (backward shift). */
static void erase(Table *t, size_t at) {
    free_holders(t, &t->nodes[at]);
    size_t hole = at, next = at;
    for (;;) {
        next = (next + 1) & t->mask;
        Node *candidate = &t->nodes[next];
        if (!candidate->count) break;
        size_t home = home_of(t, candidate->key);
        /* The candidate may fill the hole unless its home lies cyclically in
           (hole, next]: then it must stay at or after its home. */
        int stays = hole <= next ? (home > hole && home <= next) : (home > hole || home <= next);
        if (!stays) {
            t->nodes[hole] = *candidate;
            hole = next;
        }
    }
    memset(&t->nodes[hole], 0, sizeof(Node));
    t->used--;
}

/* -- holders of one node ----------------------------------------------------------- */

static HolderArray *resize_array(Table *t, HolderArray *array, uint32_t capacity) {
    uint32_t before = array ? array->capacity : 0;
    array = PyMem_Realloc(array, sizeof(HolderArray) + capacity * sizeof(uint32_t));
    if (array == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    array->capacity = capacity;
    t->array_bytes += (capacity - before) * sizeof(uint32_t) + (before ? 0 : sizeof(HolderArray));
    return array;
}

static int insert_holder(Table *t, Node *node, uint32_t position, uint32_t holder) {
    if (node->count == 1) { /* a second holder: the node moves to an array of the pool */
        int64_t number = take_array_number(t);
        if (number < 0) return -1;
        HolderArray *array = resize_array(t, NULL, 4);
        if (array == NULL) {
            t->free_arrays[t->free_count++] = (uint32_t)number;
            return -1;
        }
        array->items[0] = node->holder;
        t->arrays[number] = array;
        node->holder = (uint32_t)number;
    } else if (node->count == t->arrays[node->holder]->capacity) {
        HolderArray *array = resize_array(t, t->arrays[node->holder],
                                          t->arrays[node->holder]->capacity * 2);
        if (array == NULL) return -1;
        t->arrays[node->holder] = array;
    }
    uint32_t *holders = t->arrays[node->holder]->items;
    memmove(holders + position + 1, holders + position, (node->count - position) * 4);
    holders[position] = holder;
    node->count++;
    return 0;
}

/* Drop the holder at `position`; the node is left empty (count 0) when it was the last,
   for the caller to erase. */
static void delete_holder(Table *t, Node *node, uint32_t position) {
    if (node->count == 1) {
        node->count = 0;
        return;
    }
    uint32_t number = node->holder;
    uint32_t *holders = t->arrays[number]->items;
    memmove(holders + position, holders + position + 1, (node->count - position - 1) * 4);
    node->count--;
    if (node->count == 1) { /* back inline */
        node->holder = holders[0];
        release_array(t, number);
    }
}

static inline void count_entries(Table *t, uint32_t slot, uint32_t bits, int64_t sign) {
    for (int tier = 0; tier < t->tiers; tier++) {
        if (bits & (1u << tier)) {
            t->slot_entries[(size_t)slot * t->tiers + tier] += sign;
            t->entries += sign;
        }
    }
}

/* -- applying runs ----------------------------------------------------------------- */

static int store(Table *t, uint32_t slot, int tier, const uint64_t *keys, Py_ssize_t n,
                 int64_t first_position) {
    const uint32_t bit = 1u << tier;
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((t->used + 1) * 5 > (t->mask + 1) * 4 && grow(t) < 0) return -1;
        Node *node = &t->nodes[probe(t, keys[i], home_of(t, keys[i]))];
        if (!node->count) { /* a new key: this holder is its first */
            int64_t depth = first_position + i;
            node->key = keys[i];
            node->depth = (uint16_t)(depth < MAX_DEPTH ? depth : MAX_DEPTH);
            node->holder = slot << 8 | bit;
            node->count = 1;
            t->used++;
            count_entries(t, slot, bit, 1);
            continue;
        }
        uint32_t *holders = holders_of(t, node);
        uint32_t position = lower_bound(holders, 0, node->count, slot);
        if (position < node->count && holder_slot(holders[position]) == slot) {
            if (!(holders[position] & bit)) {
                holders[position] |= bit;
                count_entries(t, slot, bit, 1);
            }
        } else {
            if (insert_holder(t, node, position, slot << 8 | bit) < 0) return -1;
            count_entries(t, slot, bit, 1);
        }
    }
    return 0;
}

static void remove_keys(Table *t, uint32_t slot, int tier, const uint64_t *keys, Py_ssize_t n) {
    const uint32_t bit = 1u << tier;
    for (Py_ssize_t i = 0; i < n; i++) {
        size_t at = probe(t, keys[i], home_of(t, keys[i]));
        Node *node = &t->nodes[at];
        if (!node->count) continue;
        uint32_t *holders = holders_of(t, node);
        uint32_t position = lower_bound(holders, 0, node->count, slot);
        if (position == node->count || holder_slot(holders[position]) != slot) continue;
        if (!(holders[position] & bit)) continue;
        holders[position] &= ~bit;
        count_entries(t, slot, bit, -1);
        if (!(holders[position] & 0xffu)) {
            delete_holder(t, node, position);
            if (!node->count) erase(t, at);
        }
    }
}

/* Drop every entry of `slot`: a scan of the whole table (workers leave rarely). */
static void clear_slot(Table *t, uint32_t slot) {
    if (slot >= t->slots) return;
    int64_t held = 0;
    for (int tier = 0; tier < t->tiers; tier++) held += t->slot_entries[(size_t)slot * t->tiers + tier];
    for (size_t at = 0; at <= t->mask && held > 0;) {
        Node *node = &t->nodes[at];
        if (node->count) {
            uint32_t *holders = holders_of(t, node);
            uint32_t position = lower_bound(holders, 0, node->count, slot);
            if (position < node->count && holder_slot(holders[position]) == slot) {
                held -= popcount8(holders[position]);
                count_entries(t, slot, holders[position], -1);
                delete_holder(t, node, position);
                if (!node->count) {
                    erase(t, at); /* a later node may have moved here: look again */
                    continue;
                }
            }
        }
        at++;
    }
}

/* -- the Python type --------------------------------------------------------------- */

/* The n ints at items into out; ValueError if any is not an unsigned 64-bit int. */
static int read_keys(PyObject *const *items, Py_ssize_t n, uint64_t *out) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = items[i];
        if (!PyLong_Check(item)) goto bad;
        out[i] = PyLong_AsUnsignedLongLong(item);
        if (out[i] == (uint64_t)-1 && PyErr_Occurred()) goto bad;
    }
    return 0;
bad:
    PyErr_Clear();
    PyErr_SetString(PyExc_ValueError, "block keys must be unsigned 64-bit integers");
    return -1;
}

static void Table_dealloc(Table *t) {
    if (t->nodes != NULL) {
        for (size_t i = 0; i <= t->mask; i++) free_holders(t, &t->nodes[i]);
        free_nodes(t->nodes, t->mask + 1);
        PyMem_Free(t->arrays);
        PyMem_Free(t->free_arrays);
    }
    PyMem_Free(t->slot_entries);
    Py_XDECREF(t->match_type);
    Py_XDECREF(t->by_tier);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static int Table_init(Table *t, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"tiers", "seed", "match", "by_tier", "capacity", NULL};
    int tiers;
    unsigned long long seed;
    PyObject *match_type = NULL, *by_tier = NULL;
    Py_ssize_t capacity = 1024;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iK|$OOn", names, &tiers, &seed, &match_type,
                                     &by_tier, &capacity))
        return -1;
    if (check_match_builders(match_type, by_tier) < 0) return -1;
    if (tiers < 1 || tiers > MAX_TIERS) {
        PyErr_Format(PyExc_ValueError, "tiers must be in 1..%d", MAX_TIERS);
        return -1;
    }
    if (capacity < 2 || (capacity & (capacity - 1))) {
        PyErr_SetString(PyExc_ValueError, "capacity must be a power of two, 2 or more");
        return -1;
    }
    if (t->nodes != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a LocationTable is initialised once");
        return -1;
    }
    t->tiers = tiers;
    t->seed = seed;
    Py_INCREF(match_type);
    t->match_type = (PyTypeObject *)match_type;
    Py_INCREF(by_tier);
    t->by_tier = by_tier;
    t->multiplier = mix(seed, 0x9e3779b97f4a7c15ULL, 1) | 1;
    return allocate(t, (size_t)capacity);
}

/* Methods of a table whose __init__ never ran (or failed) raise rather than crash. */
static int not_ready(const Table *t) {
    if (t->nodes != NULL) return 0;
    PyErr_SetString(PyExc_RuntimeError, "this LocationTable was not initialised");
    return 1;
}

static int parse_slot(PyObject *object, uint32_t *slot) {
    long value = PyLong_AsLong(object);
    if (value == -1 && PyErr_Occurred()) return -1;
    if (value < 0 || value > (long)MAX_SLOT) {
        PyErr_Format(PyExc_ValueError, "worker slot must be in 0..%u", MAX_SLOT);
        return -1;
    }
    *slot = (uint32_t)value;
    return 0;
}

/* apply(slot, runs): runs is a list of (kind, tier, keys, first_position) tuples,
   kind 0 store, 1 remove, 2 clear. Every run is checked and its keys read before any is
   applied, so a bad one changes nothing. */
static PyObject *Table_apply(Table *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "apply() takes a slot and a list of runs");
        return NULL;
    }
    uint32_t slot;
    if (not_ready(t) || parse_slot(args[0], &slot) < 0) return NULL;
    PyObject *runs = args[1];
    Py_ssize_t count = PyList_GET_SIZE(runs), total = 0;
    /* Each run read once, into C: nothing a second read could see differently. */
    typedef struct {
        long kind;
        int tier;
        long long first;
        Py_ssize_t n;
    } Run;
    Run *parsed = PyMem_Malloc((count ? count : 1) * sizeof(Run));
    if (parsed == NULL) return PyErr_NoMemory();
    for (Py_ssize_t r = 0; r < count; r++) {
        PyObject *run = PyList_GET_ITEM(runs, r);
        if (!PyTuple_Check(run) || PyTuple_GET_SIZE(run) != 4 ||
            !PyList_Check(PyTuple_GET_ITEM(run, 2)) || !PyLong_Check(PyTuple_GET_ITEM(run, 0)) ||
            !PyLong_Check(PyTuple_GET_ITEM(run, 1)) || !PyLong_Check(PyTuple_GET_ITEM(run, 3))) {
            PyErr_SetString(PyExc_TypeError, "a run is (kind, tier, list of keys, first_position)");
            PyMem_Free(parsed);
            return NULL;
        }
        long kind = PyLong_AsLong(PyTuple_GET_ITEM(run, 0));
        long tier = PyLong_AsLong(PyTuple_GET_ITEM(run, 1));
        long long first = PyLong_AsLongLong(PyTuple_GET_ITEM(run, 3));
        if (PyErr_Occurred()) {
            PyMem_Free(parsed);
            return NULL;
        }
        if (kind < RUN_STORE || kind > RUN_CLEAR || tier < 0 || tier >= t->tiers || first < 0) {
            PyErr_SetString(PyExc_ValueError, "a run's kind, tier or first_position is out of range");
            PyMem_Free(parsed);
            return NULL;
        }
        /* Depths saturate at MAX_DEPTH: clamping here keeps first + i from overflowing. */
        parsed[r] = (Run){kind, (int)tier, first < MAX_DEPTH ? first : MAX_DEPTH,
                          PyList_GET_SIZE(PyTuple_GET_ITEM(run, 2))};
        total += parsed[r].n;
    }
    uint64_t *keys = PyMem_Malloc((total ? total : 1) * sizeof(uint64_t));
    if (keys == NULL) {
        PyMem_Free(parsed);
        return PyErr_NoMemory();
    }
    Py_ssize_t offset = 0;
    for (Py_ssize_t r = 0; r < count; r++) {
        PyObject *list = PyTuple_GET_ITEM(PyList_GET_ITEM(runs, r), 2);
        Py_ssize_t n = parsed[r].n;
        if (read_keys(PySequence_Fast_ITEMS(list), n, keys + offset) < 0) {
            PyMem_Free(parsed);
            PyMem_Free(keys);
            return NULL;
        }
        offset += n;
    }
    if (reserve_slot(t, slot) < 0) {
        PyMem_Free(parsed);
        PyMem_Free(keys);
        return NULL;
    }
    offset = 0;
    for (Py_ssize_t r = 0; r < count; r++) {
        long kind = parsed[r].kind;
        int tier = parsed[r].tier;
        Py_ssize_t n = parsed[r].n;
        if (kind == RUN_STORE) {
            if (store(t, slot, tier, keys + offset, n, parsed[r].first) < 0) {
                PyMem_Free(parsed);
                /* Only memory can fail here, after the runs before were applied. */
                PyMem_Free(keys);
                return NULL;
            }
        } else if (kind == RUN_REMOVE) {
            remove_keys(t, slot, tier, keys + offset, n);
        } else {
            clear_slot(t, slot);
        }
        offset += n;
    }
    PyMem_Free(parsed);
    PyMem_Free(keys);
    Py_RETURN_NONE;
}

static PyObject *Table_clear(Table *t, PyObject *slot_object) {
    uint32_t slot;
    if (not_ready(t) || parse_slot(slot_object, &slot) < 0) return NULL;
    clear_slot(t, slot);
    Py_RETURN_NONE;
}

/* A worker still matching during a lookup, and the blocks it matched per tier. */
typedef struct {
    uint32_t slot;
    uint32_t tier; /* the tier its last matched block counted on */
    int32_t by_tier[MAX_TIERS];
} Match;

/* Count `run` more blocks for every matching worker, each on its last block's tier. */
static void add_run(Match *active, uint32_t matching, int32_t run) {
    if (!run) return;
    for (uint32_t a = 0; a < matching; a++) active[a].by_tier[active[a].tier] += run;
}

/* Put the match of `slot` into `out`: worker id -> match_type(worker id, incarnation,
   blocks, by_tier(blocks per tier)). names[slot] is the slot's (worker id, incarnation). */
static int emit(Table *t, PyObject *out, PyObject *names, const Match *match, Py_ssize_t blocks) {
    PyObject *name = (Py_ssize_t)match->slot < PyList_GET_SIZE(names)
                         ? PyList_GET_ITEM(names, match->slot)
                         : NULL;
    if (name == NULL || !PyTuple_Check(name) || PyTuple_GET_SIZE(name) != 2) {
        PyErr_Format(PyExc_ValueError, "live slot %u has no (worker id, incarnation)", match->slot);
        return -1;
    }
    PyObject *worker_id = PyTuple_GET_ITEM(name, 0);
    PyObject *result = new_match(t->match_type, t->by_tier, worker_id, PyTuple_GET_ITEM(name, 1),
                                 blocks, match->by_tier, t->tiers);
    if (result == NULL) return -1;
    int failed = PyDict_SetItem(out, worker_id, result);
    Py_DECREF(result);
    return failed;
}

/* lookup(keys, names) -> {worker id: match} for each live slot that holds keys[0]: its
   longest consecutive matched prefix, a block held on several tiers counted on its
   fastest. names[slot] is a live slot's (worker id, incarnation), None for any other. */
static PyObject *Table_lookup(Table *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_Check(args[0]) || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "lookup() takes a list of keys and a list of names");
        return NULL;
    }
    if (not_ready(t)) return NULL;
    /* Neither list can change below: nothing runs Python code until the results are
       built, after the walk. */
    PyObject *names = args[1];
    Py_ssize_t n = PyList_GET_SIZE(args[0]);
    Match *active = NULL, *results = NULL;
    Py_ssize_t *result_blocks = NULL;
    uint32_t result_count = 0;
    PyObject *out = NULL;
    if (n == 0 || t->used == 0) goto build;
    uint64_t *keys = PyMem_Malloc(n * (sizeof(uint64_t) + sizeof(size_t)));
    if (keys == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    size_t *homes = (size_t *)(keys + n);
    if (read_keys(PySequence_Fast_ITEMS(args[0]), n, keys) < 0) {
        PyMem_Free(keys);
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        homes[i] = home_of(t, keys[i]);
        if (i < PREFETCH_AHEAD) __builtin_prefetch(&t->nodes[homes[i]]);
    }
    /* From here to `build` no Python API is called: nothing can change the table. */
    Node *node = find(t, keys[0], homes[0]);
    if (node == NULL) {
        PyMem_Free(keys);
        goto build;
    }
    active = PyMem_Malloc(node->count * sizeof(Match));
    results = PyMem_Malloc(node->count * sizeof(Match));
    result_blocks = PyMem_Malloc(node->count * sizeof(Py_ssize_t));
    if (active == NULL || results == NULL || result_blocks == NULL) {
        PyMem_Free(keys);
        PyErr_NoMemory();
        goto fail;
    }
    uint32_t matching = 0;
    const uint32_t *holders = holders_of(t, node);
    for (uint32_t h = 0; h < node->count; h++) {
        uint32_t slot = holder_slot(holders[h]);
        if ((Py_ssize_t)slot >= PyList_GET_SIZE(names) || PyList_GET_ITEM(names, slot) == Py_None)
            continue;
        Match *match = &active[matching++];
        memset(match, 0, sizeof(Match));
        match->slot = slot;
        match->tier = __builtin_ctz(holders[h]);
        match->by_tier[match->tier] = 1;
    }
    /* Blocks whose holders (slots and tiers) equal the previous block's leave the
       matching workers as they are: such a run is counted once it ends, so a shared
       prefix costs a comparison a block, not a step per worker. */
    const uint32_t *previous = holders;
    uint32_t previous_count = node->count;
    int32_t run = 0;
    Py_ssize_t length = 1;
    for (; length < n && matching; length++) {
        if (length + PREFETCH_AHEAD < n) __builtin_prefetch(&t->nodes[homes[length + PREFETCH_AHEAD]]);
        node = find(t, keys[length], homes[length]);
        if (node == NULL) break;
        holders = holders_of(t, node);
        const uint32_t count = node->count;
        if (count == previous_count && !memcmp(holders, previous, count * sizeof(uint32_t))) {
            run++;
            continue;
        }
        add_run(active, matching, run);
        run = 0;
        previous = holders;
        previous_count = count;
        /* Intersect the matching workers with the node's holders, both sorted by slot:
           a linear merge, or binary searches when the holders far outnumber them. */
        const int search = count > 8 * matching;
        uint32_t kept = 0, h = 0;
        for (uint32_t a = 0; a < matching; a++) {
            const uint32_t slot = active[a].slot;
            if (search)
                h = lower_bound(holders, h, count, slot);
            else
                while (h < count && holder_slot(holders[h]) < slot) h++;
            if (h < count && holder_slot(holders[h]) == slot) {
                active[a].tier = __builtin_ctz(holders[h]);
                active[a].by_tier[active[a].tier]++;
                if (kept != a) active[kept] = active[a];
                kept++;
            } else {
                results[result_count] = active[a];
                result_blocks[result_count++] = length;
            }
        }
        matching = kept;
    }
    add_run(active, matching, run);
    for (uint32_t a = 0; a < matching; a++) {
        results[result_count] = active[a];
        result_blocks[result_count++] = length;
    }
    PyMem_Free(keys);
build:
    out = PyDict_New();
    if (out == NULL) goto fail;
    for (uint32_t r = 0; r < result_count; r++)
        if (emit(t, out, names, &results[r], result_blocks[r]) < 0) goto fail;
    PyMem_Free(active);
    PyMem_Free(results);
    PyMem_Free(result_blocks);
    return out;
fail:
    Py_XDECREF(out);
    PyMem_Free(active);
    PyMem_Free(results);
    PyMem_Free(result_blocks);
    return NULL;
}

/* evict_deepest(count) -> entries removed: every entry deeper than the shallowest depth
   whose deeper-or-equal entries cover count, then entries at that depth until count
   is reached. */
static PyObject *Table_evict_deepest(Table *t, PyObject *count_object) {
    if (not_ready(t)) return NULL;
    long long wanted = PyLong_AsLongLong(count_object);
    if (wanted == -1 && PyErr_Occurred()) return NULL;
    if (wanted <= 0 || t->used == 0) return PyLong_FromLong(0);
    int64_t *at_depth = PyMem_Calloc(MAX_DEPTH + 1, sizeof(int64_t));
    if (at_depth == NULL) return PyErr_NoMemory();
    for (size_t i = 0; i <= t->mask; i++) {
        Node *node = &t->nodes[i];
        if (!node->count) continue;
        const uint32_t *holders = holders_of(t, node);
        for (uint32_t h = 0; h < node->count; h++) at_depth[node->depth] += popcount8(holders[h]);
    }
    int threshold = MAX_DEPTH;
    int64_t covered = at_depth[MAX_DEPTH];
    while (threshold > 0 && covered < wanted) covered += at_depth[--threshold];
    /* Entries to take at the threshold depth: what the deeper ones leave of the count. */
    const int64_t budget = wanted - (covered - at_depth[threshold]);
    PyMem_Free(at_depth);
    int64_t removed = 0, taken = 0;
    for (size_t at = 0; at <= t->mask;) {
        Node *node = &t->nodes[at];
        if (node->count && (node->depth > threshold || (node->depth == threshold && taken < budget))) {
            const uint32_t *holders = holders_of(t, node);
            for (uint32_t h = 0; h < node->count; h++) {
                if (node->depth == threshold) taken += popcount8(holders[h]);
                removed += popcount8(holders[h]);
                count_entries(t, holder_slot(holders[h]), holders[h], -1);
            }
            erase(t, at); /* a later node may have moved here: look again */
            continue;
        }
        at++;
    }
    return PyLong_FromLongLong(removed);
}

static PyObject *Table_slot_entries(Table *t, PyObject *slot_object) {
    uint32_t slot;
    if (parse_slot(slot_object, &slot) < 0) return NULL;
    int64_t held = 0;
    if (slot < t->slots)
        for (int tier = 0; tier < t->tiers; tier++) held += t->slot_entries[(size_t)slot * t->tiers + tier];
    return PyLong_FromLongLong(held);
}

static PyObject *Table_depth(Table *t, PyObject *key_object) {
    if (not_ready(t)) return NULL;
    unsigned long long key = PyLong_AsUnsignedLongLong(key_object);
    if (key == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (t->used == 0) Py_RETURN_NONE;
    Node *node = find(t, key, home_of(t, key));
    if (node == NULL) Py_RETURN_NONE;
    return PyLong_FromLong(node->depth);
}

static PyObject *Table_get_entries(Table *t, void *closure) {
    (void)closure;
    return PyLong_FromLongLong(t->entries);
}

static PyObject *Table_get_keys(Table *t, void *closure) {
    (void)closure;
    return PyLong_FromSize_t(t->used);
}

static PyObject *Table_get_capacity(Table *t, void *closure) {
    (void)closure;
    return PyLong_FromSize_t(t->mask + 1);
}

static PyObject *Table_get_nbytes(Table *t, void *closure) {
    (void)closure;
    return PyLong_FromSize_t((t->mask + 1) * sizeof(Node) + t->array_bytes +
                             t->pool_capacity * (sizeof(HolderArray *) + sizeof(uint32_t)) +
                             t->slots * t->tiers * sizeof(int64_t));
}

static PyMethodDef Table_methods[] = {
    {"apply", (PyCFunction)(void (*)(void))Table_apply, METH_FASTCALL,
     "apply(slot, runs): store, remove or clear, run by run, all checked first"},
    {"clear", (PyCFunction)Table_clear, METH_O, "clear(slot): drop every entry of the slot"},
    {"lookup", (PyCFunction)(void (*)(void))Table_lookup, METH_FASTCALL,
     "lookup(keys, names) -> {worker id: match}"},
    {"evict_deepest", (PyCFunction)Table_evict_deepest, METH_O,
     "evict_deepest(count) -> entries removed, deepest blocks first"},
    {"slot_entries", (PyCFunction)Table_slot_entries, METH_O,
     "slot_entries(slot) -> entries the slot holds"},
    {"depth", (PyCFunction)Table_depth, METH_O, "depth(key) -> the key's depth, or None"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Table_getset[] = {
    {"entries", (getter)Table_get_entries, NULL, "(key, slot, tier) entries", NULL},
    {"keys", (getter)Table_get_keys, NULL, "distinct keys held", NULL},
    {"capacity", (getter)Table_get_capacity, NULL, "nodes allocated", NULL},
    {"nbytes", (getter)Table_get_nbytes, NULL, "bytes the table allocated", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "router.index._table.LocationTable",
    .tp_basicsize = sizeof(Table),
    .tp_dealloc = (destructor)Table_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Block key -> worker slots holding it, per tier, and its depth.",
    .tp_methods = Table_methods,
    .tp_getset = Table_getset,
    .tp_init = (initproc)Table_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "router.index._table",
    .m_size = 0,
};

PyMODINIT_FUNC PyInit__table(void) {
    if (PyType_Ready(&TableType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&TableType);
    if (PyModule_AddIntConstant(m, "RUN_STORE", RUN_STORE) < 0 ||
        PyModule_AddIntConstant(m, "RUN_REMOVE", RUN_REMOVE) < 0 ||
        PyModule_AddIntConstant(m, "RUN_CLEAR", RUN_CLEAR) < 0 ||
        PyModule_AddIntConstant(m, "MAX_SLOT", MAX_SLOT) < 0 ||
        PyModule_AddObject(m, "LocationTable", (PyObject *)&TableType) < 0) {
        Py_DECREF(&TableType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
