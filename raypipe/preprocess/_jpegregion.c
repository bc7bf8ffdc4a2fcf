/* Decode one region of a JPEG with libjpeg-turbo, at a DCT scale: the rows above the
 * region are entropy-decoded and skipped (no IDCT, no colour conversion), the columns
 * outside it are not transformed (jpeg_crop_scanline), and the rows below it are never
 * read. raypipe.preprocess.region wraps it; see there for the contract.
 *
 * Strict like simplejpeg: a warning (corrupt data libjpeg would patch over) is an error,
 * so the caller's fallback (Pillow) handles every damaged file the same way.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>
#include <jerror.h>

#define ROWS_PER_READ 16 /* whole row groups, never a row the upsampler must buffer */

struct strict_error {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
};

static void on_error(j_common_ptr cinfo) {
    struct strict_error *err = (struct strict_error *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level) {
    if (level < 0) on_error(cinfo); /* a warning: corrupt data */
}

/* A JPEG with a restart marker after every MCU (what restart() writes): each MCU's
 * entropy-coded bytes stand alone, so the MCUs around a region make a JPEG of their own,
 * and the rest of the file is never entropy-decoded. */
struct layout {
    size_t sof;  /* offset of the frame header's height field */
    size_t scan; /* offset of the first entropy-coded byte */
    unsigned width, height, mcu_w, mcu_h, cols, rows;
};

static unsigned be16(const unsigned char *p) { return ((unsigned)p[0] << 8) | p[1]; }

/* 1 when data is a baseline JPEG of one interleaved scan with a restart interval of one
 * MCU; 0 when it is another JPEG, which the plain path decodes. */
static int restart_layout(const unsigned char *p, size_t n, struct layout *L) {
    size_t i = 2;
    unsigned hmax = 0, vmax = 0, comps = 0, interval = 0;
    if (n < 4 || p[0] != 0xFF || p[1] != 0xD8) return 0;
    L->sof = 0;
    while (i + 4 <= n) {
        if (p[i] != 0xFF) return 0;
        unsigned char m = p[i + 1];
        if (m == 0xFF) { i++; continue; } /* fill byte */
        size_t len = be16(p + i + 2), seg = i + 4;
        if (len < 2 || i + 2 + len > n) return 0;
        if (m == 0xC0 || m == 0xC1) {
            if (len < 8) return 0;
            L->sof = i + 5;
            L->height = be16(p + seg + 1);
            L->width = be16(p + seg + 3);
            comps = p[seg + 5];
            if (comps == 0 || len < 8 + 3 * comps || L->height == 0) return 0;
            for (unsigned c = 0; c < comps; c++) {
                unsigned hv = p[seg + 7 + 3 * c];
                if ((hv >> 4) > hmax) hmax = hv >> 4;
                if ((hv & 15) > vmax) vmax = hv & 15;
            }
        } else if ((m >= 0xC2 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC)
                   || m == 0xD9) {
            return 0; /* progressive, lossless, arithmetic-coded, or no image */
        } else if (m == 0xDD) {
            if (len < 4) return 0;
            interval = be16(p + seg);
        } else if (m == 0xDA) {
            if (!L->sof || interval != 1 || hmax == 0 || vmax == 0) return 0;
            if (len < 6 + 2 * (size_t)comps || p[seg] != comps) return 0; /* one scan, all */
            L->mcu_w = comps == 1 ? 8 : 8 * hmax;
            L->mcu_h = comps == 1 ? 8 : 8 * vmax;
            L->cols = (L->width + L->mcu_w - 1) / L->mcu_w;
            L->rows = (L->height + L->mcu_h - 1) / L->mcu_h;
            L->scan = i + 2 + len;
            return 1;
        }
        i += 2 + len;
    }
    return 0;
}

/* The entropy-coded bytes of every MCU: starts[k]..ends[k). -1 where the markers are not
 * one after each MCU, numbered in turn, up to the end marker (a damaged file). */
static int index_mcus(const unsigned char *p, size_t n, const struct layout *L,
                      size_t *starts, size_t *ends) {
    size_t total = (size_t)L->cols * L->rows, k = 0, i = L->scan;
    starts[0] = i;
    for (;;) {
        const unsigned char *ff = memchr(p + i, 0xFF, n - i);
        if (ff == NULL || (size_t)(ff - p) + 1 >= n) return -1;
        i = (size_t)(ff - p);
        unsigned char b = p[i + 1];
        if (b == 0x00 || b == 0xFF) { i += 1 + (b == 0x00); continue; }
        ends[k] = i;
        if (b >= 0xD0 && b <= 0xD7) {
            if (b != 0xD0 + (k & 7) || ++k >= total) return -1;
            starts[k] = i + 2;
            i += 2;
            continue;
        }
        return (b == 0xD9 && k + 1 == total) ? 0 : -1;
    }
}

/* The JPEG of MCU columns c0..c1 and rows r0..r1 of data, in a new buffer (free it). */
static unsigned char *cut_mcus(const unsigned char *p, const struct layout *L,
                               const size_t *starts, const size_t *ends, unsigned c0,
                               unsigned c1, unsigned r0, unsigned r1, size_t *size) {
    size_t need = L->scan + 2;
    for (unsigned r = r0; r <= r1; r++) {
        size_t a = (size_t)r * L->cols;
        need += ends[a + c1] - starts[a + c0] + 2; /* within bounds of the original */
    }
    unsigned char *out = malloc(need);
    if (out == NULL) return NULL;
    memcpy(out, p, L->scan);
    unsigned w = (c1 + 1) * L->mcu_w, h = (r1 + 1) * L->mcu_h;
    if (w > L->width) w = L->width;
    if (h > L->height) h = L->height;
    w -= c0 * L->mcu_w;
    h -= r0 * L->mcu_h;
    out[L->sof] = (unsigned char)(h >> 8);
    out[L->sof + 1] = (unsigned char)h;
    out[L->sof + 2] = (unsigned char)(w >> 8);
    out[L->sof + 3] = (unsigned char)w;
    size_t o = L->scan, k = 0;
    for (unsigned r = r0; r <= r1; r++) {
        for (unsigned c = c0; c <= c1; c++, k++) {
            size_t m = (size_t)r * L->cols + c;
            if (k) { out[o++] = 0xFF; out[o++] = (unsigned char)(0xD0 + ((k - 1) & 7)); }
            memcpy(out + o, p + starts[m], ends[m] - starts[m]);
            o += ends[m] - starts[m];
        }
    }
    out[o++] = 0xFF;
    out[o++] = 0xD9;
    *size = o;
    return out;
}

static PyObject *decode_plain(Py_buffer *src, const unsigned char *data, size_t size, int denom,
                              int left, int top, int width, int height, unsigned x_shift);

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer src;
    int denom, left, top, width, height;
    if (!PyArg_ParseTuple(args, "y*iiiii", &src, &denom, &left, &top, &width, &height))
        return NULL;
    if (denom != 1 && denom != 2 && denom != 4 && denom != 8) {
        PyBuffer_Release(&src);
        return PyErr_Format(PyExc_ValueError, "scale 1/%d: not 1, 2, 4 or 8", denom);
    }
    const unsigned char *p = (const unsigned char *)src.buf;
    struct layout L = {0};
    if (!restart_layout(p, (size_t)src.len, &L) || left < 0 || top < 0 || width <= 0
            || height <= 0)
        return decode_plain(&src, p, (size_t)src.len, denom, left, top, width, height, 0);
    /* the MCUs under the region, and the one beside where the region starts (or ends)
     * on an MCU's edge: the chroma upsampling reads one chroma sample past each side */
    unsigned bw = L.mcu_w / (unsigned)denom, bh = L.mcu_h / (unsigned)denom;
    unsigned right = (unsigned)left + (unsigned)width, bottom = (unsigned)top + (unsigned)height;
    unsigned c0 = (unsigned)left / bw, c1 = (right - 1) / bw;
    unsigned r0 = (unsigned)top / bh, r1 = (bottom - 1) / bh;
    if (c0 > 0 && (unsigned)left % bw == 0) c0--;
    if (r0 > 0 && (unsigned)top % bh == 0) r0--;
    if (right % bw == 0) c1++;
    if (bottom % bh == 0) r1++;
    if (c1 >= L.cols) c1 = L.cols - 1;
    if (r1 >= L.rows) r1 = L.rows - 1;
    /* two MCUs across at least: libjpeg upsamples chroma two samples wide or less
     * plainly, where the whole image's is fancy (a partial MCU at the right edge) */
    if (c0 == c1 && L.cols > 1) {
        if (c0 > 0) c0--;
        else c1++;
    }
    unsigned sw = (L.width + (unsigned)denom - 1) / (unsigned)denom;
    unsigned sh = (L.height + (unsigned)denom - 1) / (unsigned)denom;
    if (right > sw || bottom > sh || c0 > c1 || r0 > r1) /* outside: the plain path says so */
        return decode_plain(&src, p, (size_t)src.len, denom, left, top, width, height, 0);
    size_t total = (size_t)L.cols * L.rows, size = 0;
    if (total == 0 || total - 1 > ((size_t)src.len - L.scan) / 2) { /* MCUs but the last: RSTn */
        PyBuffer_Release(&src);
        return PyErr_Format(PyExc_ValueError,
                            "libjpeg: %zu MCUs and their restart markers cannot fit in %zd bytes",
                            total, src.len);
    }
    size_t *starts = malloc(2 * total * sizeof(size_t));
    if (starts == NULL) { PyBuffer_Release(&src); return PyErr_NoMemory(); }
    unsigned char *cut = NULL;
    int bad = index_mcus(p, (size_t)src.len, &L, starts, starts + total);
    if (!bad) cut = cut_mcus(p, &L, starts, starts + total, c0, c1, r0, r1, &size);
    free(starts);
    if (bad) {
        PyBuffer_Release(&src);
        return PyErr_Format(PyExc_ValueError,
                            "libjpeg: restart markers out of place (damaged data)");
    }
    if (cut == NULL) { PyBuffer_Release(&src); return PyErr_NoMemory(); }
    PyObject *got = decode_plain(NULL, cut, size, denom, left - (int)(c0 * bw),
                                 top - (int)(r0 * bh), width, height, c0 * bw);
    free(cut);
    PyBuffer_Release(&src);
    return got;
}

/* src (released here) owns data where given; NULL where the caller owns it. The columns
 * returned are shifted by x_shift: the cut's first column in the whole image. */
static PyObject *decode_plain(Py_buffer *src, const unsigned char *data, size_t size, int denom,
                              int left, int top, int width, int height, unsigned x_shift) {
    struct jpeg_decompress_struct cinfo;
    struct strict_error err;
    PyObject *volatile out = NULL;
    PyThreadState *volatile released = NULL;
    volatile int made = 0;
    JDIMENSION x0 = 0, cols = 0;

    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    err.pub.emit_message = on_message;
    err.message[0] = '\0';
    if (setjmp(err.jump)) {
        if (released) PyEval_RestoreThread(released);
        if (made) jpeg_destroy_decompress(&cinfo);
        Py_XDECREF(out);
        if (src) PyBuffer_Release(src);
        return PyErr_Format(PyExc_ValueError, "libjpeg: %s", err.message);
    }
    jpeg_create_decompress(&cinfo);
    made = 1;
    jpeg_mem_src(&cinfo, data, (unsigned long)size);
    jpeg_read_header(&cinfo, TRUE);
    cinfo.out_color_space = JCS_RGB;
    cinfo.scale_num = 1;
    cinfo.scale_denom = (unsigned int)denom;
    released = PyEval_SaveThread();
    jpeg_start_decompress(&cinfo);
    PyEval_RestoreThread(released);
    released = NULL;
    if (left < 0 || top < 0 || width <= 0 || height <= 0
            || (JDIMENSION)left + (JDIMENSION)width > cinfo.output_width
            || (JDIMENSION)top + (JDIMENSION)height > cinfo.output_height) {
        PyErr_Format(PyExc_ValueError, "region %dx%d at (%d, %d) outside the %ux%u image",
                     width, height, left, top, cinfo.output_width, cinfo.output_height);
        jpeg_destroy_decompress(&cinfo);
        if (src) PyBuffer_Release(src);
        return NULL;
    }
    x0 = (JDIMENSION)left;
    cols = (JDIMENSION)width;
    if (cols < cinfo.output_width) jpeg_crop_scanline(&cinfo, &x0, &cols);
    size_t stride = (size_t)cinfo.output_width * 3; /* output_width is now cols */
    out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(stride * (size_t)height));
    if (out == NULL) {
        jpeg_destroy_decompress(&cinfo);
        if (src) PyBuffer_Release(src);
        return NULL;
    }
    unsigned char *pixels = (unsigned char *)PyByteArray_AS_STRING(out);
    released = PyEval_SaveThread();
    if (top > 0) jpeg_skip_scanlines(&cinfo, (JDIMENSION)top);
    JSAMPROW rows[ROWS_PER_READ];
    while (cinfo.output_scanline < (JDIMENSION)(top + height)) {
        JDIMENSION at = cinfo.output_scanline - (JDIMENSION)top;
        JDIMENSION n = (JDIMENSION)height - at;
        if (n > ROWS_PER_READ) n = ROWS_PER_READ;
        for (JDIMENSION r = 0; r < n; r++) rows[r] = pixels + stride * (at + r);
        jpeg_read_scanlines(&cinfo, rows, n);
    }
    jpeg_abort_decompress(&cinfo); /* the rows below the region are never decoded */
    PyEval_RestoreThread(released);
    released = NULL;
    jpeg_destroy_decompress(&cinfo);
    if (src) PyBuffer_Release(src);
    return Py_BuildValue("(NII)", out, (unsigned int)x0 + x_shift, (unsigned int)cols);
}

/* A destination that grows its own buffer (libjpeg's memory destination frees a buffer
 * it outgrew and says where the new one is only when done: on an error in between, the
 * caller's pointer is stale). Heap-held, so its fields are sound after a longjmp. */
struct grown {
    struct jpeg_destination_mgr pub;
    unsigned char *buf;
    size_t size;
};

static void grown_init(j_compress_ptr c) {
    struct grown *d = (struct grown *)c->dest;
    d->pub.next_output_byte = d->buf;
    d->pub.free_in_buffer = d->size;
}

static boolean grown_empty(j_compress_ptr c) { /* the buffer is full: double it */
    struct grown *d = (struct grown *)c->dest;
    unsigned char *more = realloc(d->buf, 2 * d->size);
    if (more == NULL) ERREXIT1(c, JERR_OUT_OF_MEMORY, 10);
    d->pub.next_output_byte = more + d->size;
    d->pub.free_in_buffer = d->size;
    d->buf = more;
    d->size *= 2;
    return TRUE;
}

static void grown_term(j_compress_ptr c) {
    struct grown *d = (struct grown *)c->dest;
    d->size -= d->pub.free_in_buffer;
}

/* The same JPEG, losslessly: its DCT coefficients, quantisation tables and markers as
 * they are, Huffman-coded again (optimal tables) as one baseline scan with a restart
 * marker after every MCU, so that decode() reads a region's MCUs alone. */
static PyObject *restart(PyObject *self, PyObject *args) {
    Py_buffer src;
    if (!PyArg_ParseTuple(args, "y*", &src)) return NULL;
    struct jpeg_decompress_struct in;
    struct jpeg_compress_struct out;
    struct strict_error err;
    volatile int made_in = 0, made_out = 0;
    PyThreadState *volatile released = NULL;
    struct grown *const dest = calloc(1, sizeof(struct grown));
    if (dest != NULL) dest->buf = malloc(dest->size = (size_t)src.len + 4096);
    if (dest == NULL || dest->buf == NULL) {
        if (dest) free(dest);
        PyBuffer_Release(&src);
        return PyErr_NoMemory();
    }

    in.err = out.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    err.pub.emit_message = on_message;
    err.message[0] = '\0';
    if (setjmp(err.jump)) {
        if (released) PyEval_RestoreThread(released);
        if (made_out) jpeg_destroy_compress(&out);
        if (made_in) jpeg_destroy_decompress(&in);
        free(dest->buf);
        free(dest);
        PyBuffer_Release(&src);
        return PyErr_Format(PyExc_ValueError, "libjpeg: %s", err.message);
    }
    released = PyEval_SaveThread();
    jpeg_create_decompress(&in);
    made_in = 1;
    jpeg_create_compress(&out);
    made_out = 1;
    jpeg_mem_src(&in, (const unsigned char *)src.buf, (unsigned long)src.len);
    jpeg_save_markers(&in, JPEG_COM, 0xFFFF);
    for (int m = 0; m < 16; m++) jpeg_save_markers(&in, JPEG_APP0 + m, 0xFFFF);
    jpeg_read_header(&in, TRUE);
    jvirt_barray_ptr *coefs = jpeg_read_coefficients(&in);
    jpeg_copy_critical_parameters(&in, &out);
    out.optimize_coding = TRUE;
    out.restart_interval = 1;
    out.write_JFIF_header = in.saw_JFIF_marker; /* none added where the file had none */
    dest->pub.init_destination = grown_init;
    dest->pub.empty_output_buffer = grown_empty;
    dest->pub.term_destination = grown_term;
    out.dest = &dest->pub;
    jpeg_write_coefficients(&out, coefs);
    for (jpeg_saved_marker_ptr m = in.marker_list; m != NULL; m = m->next) {
        if (out.write_JFIF_header && m->marker == JPEG_APP0 && m->data_length >= 5
                && memcmp(m->data, "JFIF", 5) == 0)
            continue; /* written already */
        if (out.write_Adobe_marker && m->marker == JPEG_APP0 + 14 && m->data_length >= 5
                && memcmp(m->data, "Adobe", 5) == 0)
            continue;
        jpeg_write_marker(&out, m->marker, m->data, m->data_length);
    }
    jpeg_finish_compress(&out);
    jpeg_finish_decompress(&in);
    PyEval_RestoreThread(released);
    released = NULL;
    jpeg_destroy_compress(&out);
    jpeg_destroy_decompress(&in);
    PyBuffer_Release(&src);
    PyObject *result = PyBytes_FromStringAndSize((const char *)dest->buf, (Py_ssize_t)dest->size);
    free(dest->buf);
    free(dest);
    return result;
}

static PyObject *by_mcu(PyObject *self, PyObject *args) {
    Py_buffer src;
    struct layout L = {0};
    if (!PyArg_ParseTuple(args, "y*", &src)) return NULL;
    int yes = restart_layout((const unsigned char *)src.buf, (size_t)src.len, &L);
    PyBuffer_Release(&src);
    return PyBool_FromLong(yes);
}

static PyMethodDef methods[] = {
    {"by_mcu", by_mcu, METH_VARARGS,
     "by_mcu(data) -> bool\n\n"
     "Whether decode() reads a region of this JPEG's MCUs alone: a baseline JPEG of one\n"
     "scan with a restart marker after every MCU (its headers only are read)."},
    {"restart", restart, METH_VARARGS,
     "restart(data) -> bytes\n\n"
     "The JPEG re-written losslessly (the same coefficients) as one baseline scan with a\n"
     "restart marker after every MCU, which decode() reads a region of alone.\n"
     "Raises ValueError on any damage or warning."},
    {"decode", decode, METH_VARARGS,
     "decode(data, denom, left, top, width, height) -> (rgb, x0, cols)\n\n"
     "Rows top..top+height of the JPEG decoded at scale 1/denom, columns x0..x0+cols\n"
     "(the region widened to the decoder's block edges), as a bytearray of RGB rows.\n"
     "Raises ValueError on any damage or warning."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_jpegregion",
    "Region decoding with libjpeg-turbo (see raypipe.preprocess.region).", -1, methods,
};

PyMODINIT_FUNC PyInit__jpegregion(void) { return PyModule_Create(&module); }
