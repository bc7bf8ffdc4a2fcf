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

#include <jpeglib.h>

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

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer src;
    int denom, left, top, width, height;
    if (!PyArg_ParseTuple(args, "y*iiiii", &src, &denom, &left, &top, &width, &height))
        return NULL;
    if (denom != 1 && denom != 2 && denom != 4 && denom != 8) {
        PyBuffer_Release(&src);
        return PyErr_Format(PyExc_ValueError, "scale 1/%d: not 1, 2, 4 or 8", denom);
    }
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
        PyBuffer_Release(&src);
        return PyErr_Format(PyExc_ValueError, "libjpeg: %s", err.message);
    }
    jpeg_create_decompress(&cinfo);
    made = 1;
    jpeg_mem_src(&cinfo, (const unsigned char *)src.buf, (unsigned long)src.len);
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
        PyBuffer_Release(&src);
        return NULL;
    }
    x0 = (JDIMENSION)left;
    cols = (JDIMENSION)width;
    if (cols < cinfo.output_width) jpeg_crop_scanline(&cinfo, &x0, &cols);
    size_t stride = (size_t)cinfo.output_width * 3; /* output_width is now cols */
    out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(stride * (size_t)height));
    if (out == NULL) {
        jpeg_destroy_decompress(&cinfo);
        PyBuffer_Release(&src);
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
    PyBuffer_Release(&src);
    return Py_BuildValue("(NII)", out, (unsigned int)x0, (unsigned int)cols);
}

static PyMethodDef methods[] = {
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
