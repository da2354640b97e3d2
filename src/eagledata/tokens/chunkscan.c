/* The compiled core of eagledata.tokens.chunk_templates: ChunkTemplate.match_lines in one pass.
 *
 * match_template_lines(lines, start, end, head_q, q_tail, inner) reads lines[start:end] (a stream's
 * lines): the lines that start with head_q and end with q_tail (the template's "data: " + first
 * literal + '"', and '"' + last literal) are the template's lines; each one's middle (from the quote
 * ending head_q to the quote starting q_tail) is cut at the first occurrences of the inner literals in
 * turn, and every piece must be exactly one JSON string token, which is decoded. Returns
 * (found, texts) as ChunkTemplate.match_lines does (found: the indices of those lines; texts[h][j]:
 * hole h of the j-th), or None when any such line is not that (a piece that is not exactly one valid
 * string token, a missing inner literal, a lone surrogate, an item that is not a str): the caller then
 * reads the lines the Python way, which handles every case. So whenever this returns, it returns what
 * the Python reading returns (tests/test_chunkscan.py compares them).
 *
 * Why compiled: these lines are most of a streamed answer's characters (about 1,000 lines of 300
 * characters per 3,000-token answer), and doing the few string tests per line from Python cost
 * about 0.5 ms per stream, most of the stream reading's time; no library reads a JSON string token
 * in place. Optional: without a C compiler the package installs and reads the Python way.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#ifndef CHUNKSCAN_SOURCE_SHA256
#define CHUNKSCAN_SOURCE_SHA256 ""
#endif

static int hex_value(Py_UCS4 c) {
    if (c >= '0' && c <= '9') return (int)(c - '0');
    if (c >= 'a' && c <= 'f') return (int)(c - 'a' + 10);
    if (c >= 'A' && c <= 'F') return (int)(c - 'A' + 10);
    return -1;
}

/* The 4 hex digits at data[i..i+3] (all before `end`) as a code unit; -1 when not. */
static long hex4(int kind, const void *data, Py_ssize_t i, Py_ssize_t end) {
    long v = 0;
    if (i + 4 > end) return -1;
    for (Py_ssize_t k = 0; k < 4; k++) {
        int h = hex_value(PyUnicode_READ(kind, data, i + k));
        if (h < 0) return -1;
        v = v * 16 + h;
    }
    return v;
}

typedef struct {
    Py_UCS4 *buf;
    Py_ssize_t cap;
} Scratch;

/* The JSON string token s[a:b] decoded, as a new str; NULL with *bad set (no exception) when s[a:b]
 * is not exactly one valid token without lone surrogates; NULL with an exception on memory error. */
static PyObject *decode_token(PyObject *s, int kind, const void *data, Py_ssize_t a, Py_ssize_t b,
                              Scratch *scratch, int *bad) {
    if (b - a < 2 || PyUnicode_READ(kind, data, a) != '"' || PyUnicode_READ(kind, data, b - 1) != '"') {
        *bad = 1;
        return NULL;
    }
    Py_ssize_t end = b - 1; /* the closing quote */
    Py_ssize_t i = a + 1;
    for (; i < end; i++) {
        Py_UCS4 c = PyUnicode_READ(kind, data, i);
        if (c == '\\') break;
        if (c < 0x20 || c == '"' || (c >= 0xD800 && c <= 0xDFFF)) {
            *bad = 1;
            return NULL;
        }
    }
    if (i == end) return PyUnicode_Substring(s, a + 1, end);
    /* escapes: decode into the scratch buffer */
    if (scratch->cap < end - a) {
        Py_ssize_t cap = (end - a) * 2;
        Py_UCS4 *grown = PyMem_Realloc(scratch->buf, (size_t)cap * sizeof(Py_UCS4));
        if (grown == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        scratch->buf = grown;
        scratch->cap = cap;
    }
    Py_UCS4 *out = scratch->buf;
    Py_ssize_t n = 0;
    for (Py_ssize_t j = a + 1; j < i; j++) out[n++] = PyUnicode_READ(kind, data, j);
    while (i < end) {
        Py_UCS4 c = PyUnicode_READ(kind, data, i);
        if (c != '\\') {
            if (c < 0x20 || c == '"' || (c >= 0xD800 && c <= 0xDFFF)) {
                *bad = 1;
                return NULL;
            }
            out[n++] = c;
            i++;
            continue;
        }
        if (i + 1 >= end) { /* the closing quote escaped: not one token */
            *bad = 1;
            return NULL;
        }
        Py_UCS4 e = PyUnicode_READ(kind, data, i + 1);
        switch (e) {
            case '"': out[n++] = '"'; break;
            case '\\': out[n++] = '\\'; break;
            case '/': out[n++] = '/'; break;
            case 'b': out[n++] = '\b'; break;
            case 'f': out[n++] = '\f'; break;
            case 'n': out[n++] = '\n'; break;
            case 'r': out[n++] = '\r'; break;
            case 't': out[n++] = '\t'; break;
            case 'u': {
                long u = hex4(kind, data, i + 2, end);
                if (u < 0 || (u >= 0xDC00 && u <= 0xDFFF)) {
                    *bad = 1;
                    return NULL;
                }
                if (u >= 0xD800 && u <= 0xDBFF) { /* a high surrogate: its low one must follow */
                    long low = -1;
                    if (i + 7 < end && PyUnicode_READ(kind, data, i + 6) == '\\' && PyUnicode_READ(kind, data, i + 7) == 'u')
                        low = hex4(kind, data, i + 8, end);
                    if (low < 0xDC00 || low > 0xDFFF) {
                        *bad = 1;
                        return NULL;
                    }
                    out[n++] = (Py_UCS4)(0x10000 + ((u - 0xD800) << 10) + (low - 0xDC00));
                    i += 12;
                    continue;
                }
                out[n++] = (Py_UCS4)u;
                i += 6;
                continue;
            }
            default:
                *bad = 1;
                return NULL;
        }
        i += 2;
    }
    return PyUnicode_FromKindAndData(PyUnicode_4BYTE_KIND, out, n);
}

static PyObject *match_template_lines(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *lines, *head_q, *q_tail, *inner;
    Py_ssize_t start, end;
    if (!PyArg_ParseTuple(args, "O!nnUUO!", &PyList_Type, &lines, &start, &end, &head_q, &q_tail, &PyTuple_Type, &inner))
        return NULL;
    Py_ssize_t n_inner = PyTuple_GET_SIZE(inner);
    for (Py_ssize_t k = 0; k < n_inner; k++) {
        if (!PyUnicode_Check(PyTuple_GET_ITEM(inner, k))) {
            PyErr_SetString(PyExc_TypeError, "inner literals must be str");
            return NULL;
        }
    }
    if (start < 0 || end < 0 || end > PyList_GET_SIZE(lines)) /* (a slice's other readings: the Python way) */
        Py_RETURN_NONE;
    /* the middle runs from the quote ending head_q to the quote starting q_tail */
    Py_ssize_t head_len = PyUnicode_GET_LENGTH(head_q) - 1, tail_len = PyUnicode_GET_LENGTH(q_tail) - 1;
    Py_ssize_t holes = n_inner + 1;
    PyObject *found = PyList_New(0), *texts = PyList_New(holes), *result = NULL;
    Py_ssize_t *cuts = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(2 * holes));
    Scratch scratch = {NULL, 0};
    if (found == NULL || texts == NULL || cuts == NULL) {
        if (cuts == NULL) PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t h = 0; h < holes; h++) {
        PyObject *hole = PyList_New(0);
        if (hole == NULL) goto done;
        PyList_SET_ITEM(texts, h, hole);
    }
    for (Py_ssize_t i = start; i < end; i++) {
        PyObject *line = PyList_GET_ITEM(lines, i);
        if (!PyUnicode_Check(line)) goto refused;
        Py_ssize_t len = PyUnicode_GET_LENGTH(line);
        Py_ssize_t at = PyUnicode_Tailmatch(line, head_q, 0, len, -1);
        if (at < 0) goto done;
        if (!at) continue;
        at = PyUnicode_Tailmatch(line, q_tail, 0, len, 1);
        if (at < 0) goto done;
        if (!at) continue;
        Py_ssize_t cur = head_len, mid_end = len - tail_len;
        for (Py_ssize_t k = 0; k < n_inner; k++) {
            PyObject *lit = PyTuple_GET_ITEM(inner, k);
            Py_ssize_t pos = PyUnicode_Find(line, lit, cur, mid_end, 1);
            if (pos == -2) goto done;
            if (pos < 0) goto refused;
            cuts[2 * k] = cur;
            cuts[2 * k + 1] = pos;
            cur = pos + PyUnicode_GET_LENGTH(lit);
        }
        cuts[2 * n_inner] = cur;
        cuts[2 * n_inner + 1] = mid_end;
        int kind = PyUnicode_KIND(line);
        const void *data = PyUnicode_DATA(line);
        for (Py_ssize_t h = 0; h < holes; h++) {
            int bad = 0;
            PyObject *text = decode_token(line, kind, data, cuts[2 * h], cuts[2 * h + 1], &scratch, &bad);
            if (text == NULL) {
                if (bad) goto refused;
                goto done;
            }
            int failed = PyList_Append(PyList_GET_ITEM(texts, h), text);
            Py_DECREF(text);
            if (failed) goto done;
        }
        PyObject *index = PyLong_FromSsize_t(i);
        if (index == NULL) goto done;
        int failed = PyList_Append(found, index);
        Py_DECREF(index);
        if (failed) goto done;
    }
    result = PyTuple_Pack(2, found, texts);
    goto done;
refused:
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(scratch.buf);
    PyMem_Free(cuts);
    Py_XDECREF(found);
    Py_XDECREF(texts);
    return result;
}

static PyMethodDef methods[] = {
    {"match_template_lines", match_template_lines, METH_VARARGS,
     "match_template_lines(lines, start, end, head_q, q_tail, inner) -> (found, texts) or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "chunkscan", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_chunkscan(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddStringConstant(m, "SOURCE_SHA256", CHUNKSCAN_SOURCE_SHA256) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
