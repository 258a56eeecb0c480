/* A window of a JPEG decoded with libjpeg(-turbo), and only that window: the rows above it
 * skipped (jpeg_skip_scanlines), the columns beside it cropped (jpeg_crop_scanline), the rows
 * below it never read. fastdata.images.window calls it; it is optional (built where a compiler
 * and libjpeg-turbo's headers are found), and whatever it cannot decode exactly as the whole
 * image's decode would, it leaves to the caller's other path (a result of None).
 *
 * decode(data, shrink, y0, x0, y1, x1, fast, max_pixels, scan_end=-1) -> bytearray | None
 *
 *   data: the JPEG's bytes (any buffer); shrink: 1, 2, 4 or 8 (libjpeg's DCT scaling);
 *   y0, x0, y1, x1: the window in pixels of the image decoded at 1/shrink; fast: the fast
 *   integer IDCT and plain upsampling (as TurboJPEG's FASTDCT and FASTUPSAMPLE flags);
 *   max_pixels: the most window pixels allowed; scan_end: where the first scan's data ends
 *   as the record's header gives it (the offset of the marker after it), or -1 to search.
 *
 *   Returns the window's (y1 - y0) x (x1 - x0) x 3 RGB bytes, or None where this decoder does
 *   not take the image: not a sequential Huffman-coded JPEG of 1 or 3 components whose one scan
 *   holds them all and is followed by the end-of-image marker (ends_after_scan), 4x2 or 2x4
 *   subsampling at a reduced scale (rows_whole_when_cropped), a window outside the scaled image,
 *   or any warning from libjpeg (damaged data: the caller's decode decides what its pixels
 *   are). Raises ValueError on arguments out of range, and on an image libjpeg refuses (its
 *   message). Which scale and which decoder the caller's other path uses for an image is the
 *   caller's to check (fastdata.images.window).
 *
 * marker_after(data, start) -> int: the offset of the first marker at or after start (an FF
 *   followed by anything but 00, a restart marker or more FF), or -1: where a JPEG's first scan
 *   ends, which a conversion records in each record's header (fastdata.images.codec.scan_end).
 *
 * ABI: 2 (the arguments above); fastdata.images.window uses only a module built with it.
 *
 * Exactness: one iMCU of margin is decoded on each side of the window (where the image has it)
 * and dropped, so that the upsampling of the window's edge pixels sees the same neighbours as
 * in the whole image's decode. The interpreter lock is released while libjpeg runs.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>

#define MOST_ROWS 16 /* rows asked of libjpeg at once, at most (it makes 1, 2 or 4) */

enum outcome { DONE = 0, REFUSED = 1, NOT_TAKEN = 2, NO_MEMORY = 3 };

struct failure {
    struct jpeg_error_mgr mgr;
    jmp_buf jump;
    int warnings;
    char message[JMSG_LENGTH_MAX];
};

static void on_error(j_common_ptr cinfo) {
    struct failure *f = (struct failure *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, f->message);
    longjmp(f->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level) {
    if (level < 0) {  /* a warning (corrupt data, a premature end): not decoded here */
        ((struct failure *)cinfo->err)->warnings++;
    }
}

static void quiet(j_common_ptr cinfo) { (void)cinfo; }

/* The first marker at or after p (its FF), or NULL: in entropy-coded data every FF is followed
 * by 00, a restart marker or more FF, so the marker is the first FF followed by anything
 * else. */
static int is_marker(unsigned char next) {
    return next != 0x00 && next != 0xFF && (next < 0xD0 || next > 0xD7);
}

static const unsigned char *find_marker_plain(const unsigned char *p, const unsigned char *end) {
    while (p != NULL && p < end) {
        p = (const unsigned char *)memchr(p, 0xFF, (size_t)(end - p));
        if (p == NULL || p + 1 >= end) return NULL;
        if (is_marker(p[1])) return p;
        p += 1;
    }
    return NULL;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define FASTDATA_AVX2 1
/* The same, 64 bytes compared at once where the CPU has AVX2: scan data holds an FF every few
 * hundred bytes, and a memchr call for each costs about 4x this loop (4.9 against 1.1 us for
 * 100 kB in the cache, here). */
__attribute__((target("avx2"))) static const unsigned char *find_marker_avx2(
    const unsigned char *p, const unsigned char *end) {
    const __m256i ff = _mm256_set1_epi8((char)0xFF);
    while (end - p > 64) { /* (the byte after each of the 64 is in the data) */
        __m256i a = _mm256_cmpeq_epi8(_mm256_loadu_si256((const __m256i *)p), ff);
        __m256i b = _mm256_cmpeq_epi8(_mm256_loadu_si256((const __m256i *)(p + 32)), ff);
        __m256i any = _mm256_or_si256(a, b);
        if (!_mm256_testz_si256(any, any)) {
            unsigned long long mask = (unsigned long long)(unsigned)_mm256_movemask_epi8(a) |
                                      (unsigned long long)(unsigned)_mm256_movemask_epi8(b) << 32;
            while (mask != 0) {
                int i = __builtin_ctzll(mask);
                if (is_marker(p[i + 1])) return p + i;
                mask &= mask - 1;
            }
        }
        p += 64;
    }
    return find_marker_plain(p, end);
}
#endif

static const unsigned char *(*find_marker)(const unsigned char *, const unsigned char *) =
    find_marker_plain;

/* Whether the first marker after the scan that begins at p is the end of the image. A
 * decoder that reads the whole image could fail on anything else there (a second frame or
 * scan, another image's start, a marker libjpeg refuses): the window is then not decoded here,
 * so that a crop of such a file gets what its whole decode gets, whatever the window. Where
 * the record's header gives that marker's offset (scan_end >= 0: found once, when the record
 * was written), only the two bytes there are looked at, and it must lie past p; otherwise the
 * scan's data is searched. */
static int ends_after_scan(const unsigned char *p, const unsigned char *data, size_t size,
                           Py_ssize_t scan_end) {
    const unsigned char *marker;
    if (scan_end >= 0) {
        return p != NULL && (size_t)scan_end + 1 < size && data + scan_end >= p &&
               data[scan_end] == 0xFF && data[scan_end + 1] == 0xD9;
    }
    marker = find_marker(p, data + size);
    return marker != NULL && marker[1] == 0xD9;
}

/* Whether jpeg_crop_scanline sizes every component's rows right: not, before libjpeg-turbo 3.0,
 * for a component upsampled partly by a larger IDCT and partly by the upsampler (4x2 and 2x4
 * subsampling at a reduced scale): its rows are upsampled short, and the colour conversion
 * reads memory never written (libjpeg-turbo issue 669). */
static int rows_whole_when_cropped(const struct jpeg_decompress_struct *cinfo) {
    int ci;
    for (ci = 0; ci < cinfo->num_components; ci++) {
        const jpeg_component_info *c = &cinfo->comp_info[ci];
        if (c->DCT_scaled_size != cinfo->min_DCT_scaled_size &&
            (c->h_samp_factor * c->DCT_scaled_size !=
                 cinfo->max_h_samp_factor * cinfo->min_DCT_scaled_size ||
             c->v_samp_factor * c->DCT_scaled_size !=
                 cinfo->max_v_samp_factor * cinfo->min_DCT_scaled_size)) {
            return 0;
        }
    }
    return 1;
}

struct request {
    const unsigned char *data;
    size_t size;
    int shrink, y0, x0, y1, x1, fast;
    Py_ssize_t scan_end; /* -1: searched */
    unsigned char *out; /* (y1 - y0) * (x1 - x0) * 3 bytes */
};

/* No Python here: it runs without the interpreter lock. */
static enum outcome decode_window(struct request *r, struct failure *err) {
    struct jpeg_decompress_struct cinfo;
    unsigned char *volatile row = NULL;
    volatile enum outcome result = NOT_TAKEN;

    memset(&cinfo, 0, sizeof(cinfo));
    cinfo.err = jpeg_std_error(&err->mgr);
    err->mgr.error_exit = on_error;
    err->mgr.emit_message = on_message;
    err->mgr.output_message = quiet;
    err->warnings = 0;
    err->message[0] = 0;
    if (setjmp(err->jump)) {
        free(row);
        jpeg_destroy_decompress(&cinfo);
        return REFUSED;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, r->data, (unsigned long)r->size);
    if (jpeg_read_header(&cinfo, TRUE) != JPEG_HEADER_OK) goto done;
    /* every scan is read whole: progressive, arithmetic-coded, and a first scan that does not
     * hold every component (a scan per component: jpeg_start_decompress reads them all into
     * coefficients for the whole image, memory sized by the frame's declared size) */
    if (cinfo.progressive_mode || cinfo.arith_code || cinfo.comps_in_scan != cinfo.num_components) {
        goto done;
    }
    if (!ends_after_scan(cinfo.src->next_input_byte, r->data, r->size, r->scan_end)) goto done;
    if (cinfo.num_components == 3) {
        if (cinfo.jpeg_color_space != JCS_YCbCr && cinfo.jpeg_color_space != JCS_RGB) goto done;
    } else if (cinfo.num_components != 1) {
        goto done;
    }
    cinfo.out_color_space = JCS_RGB;
    cinfo.scale_num = 1;
    cinfo.scale_denom = (unsigned int)r->shrink;
    cinfo.dct_method = r->fast ? JDCT_IFAST : JDCT_ISLOW;
    cinfo.do_fancy_upsampling = r->fast ? FALSE : TRUE;
    jpeg_start_decompress(&cinfo);
    if (err->warnings || cinfo.output_components != 3 || (long)cinfo.output_height < r->y1 ||
        (long)cinfo.output_width < r->x1 || !rows_whole_when_cropped(&cinfo)) {
        goto done;
    }
    {
        /* one iMCU of the scaled image on each side, where there is one */
        int unit_w = cinfo.max_h_samp_factor * cinfo.min_DCT_scaled_size;
        int unit_h = cinfo.max_v_samp_factor * cinfo.min_DCT_scaled_size;
        JDIMENSION left = (JDIMENSION)(r->x0 > unit_w ? r->x0 - unit_w : 0);
        JDIMENSION right = (JDIMENSION)r->x1 + (JDIMENSION)unit_w;
        JDIMENSION top = (JDIMENSION)(r->y0 > unit_h ? r->y0 - unit_h : 0);
        JDIMENSION width, skipped, y, group;
        size_t row_size;
        size_t window_row = (size_t)(r->x1 - r->x0) * 3;
        if (right > cinfo.output_width) right = cinfo.output_width;
        width = right - left;
        if (left > 0 || width < cinfo.output_width) {
            jpeg_crop_scanline(&cinfo, &left, &width); /* left moves down to an iMCU edge */
        }
        if ((long)left > r->x0 || (long)(left + width) < r->x1) goto done;
        /* rows read a group at a time (as many as the decoder makes at once) */
        group = cinfo.rec_outbuf_height > 0 && cinfo.rec_outbuf_height <= MOST_ROWS
                    ? (JDIMENSION)cinfo.rec_outbuf_height
                    : 1;
        row_size = (size_t)cinfo.output_width * 3;
        row = (unsigned char *)malloc(row_size * group);
        if (row == NULL) {
            result = NO_MEMORY;
            goto done;
        }
        if (top > 0) {
            skipped = jpeg_skip_scanlines(&cinfo, top);
            if (skipped != top || err->warnings) goto done;
        }
        for (y = top; y < (JDIMENSION)r->y1;) {
            JSAMPROW rows[MOST_ROWS];
            JDIMENSION i, got, want = group;
            for (i = 0; i < group; i++) rows[i] = row + row_size * i;
            if (want > (JDIMENSION)r->y1 - y) want = (JDIMENSION)r->y1 - y;
            got = jpeg_read_scanlines(&cinfo, rows, want);
            if (got == 0 || err->warnings) goto done;
            for (i = 0; i < got; i++, y++) {
                if ((long)y >= r->y0) {
                    memcpy(r->out + (size_t)((long)y - r->y0) * window_row,
                           rows[i] + (size_t)(r->x0 - (long)left) * 3, window_row);
                }
            }
        }
        result = DONE;
    }
done:
    free(row);
    row = NULL;
    jpeg_destroy_decompress(&cinfo); /* (also what aborts the rows never read) */
    return result;
}

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer view;
    struct request r;
    struct failure err;
    long long max_pixels, pixels;
    PyObject *out;
    enum outcome result;
    (void)self;

    r.scan_end = -1;
    if (!PyArg_ParseTuple(args, "y*iiiiipL|n", &view, &r.shrink, &r.y0, &r.x0, &r.y1, &r.x1,
                          &r.fast, &max_pixels, &r.scan_end)) {
        return NULL;
    }
    if (!(r.shrink == 1 || r.shrink == 2 || r.shrink == 4 || r.shrink == 8) || r.y0 < 0 ||
        r.x0 < 0 || r.y1 <= r.y0 || r.x1 <= r.x0) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "window (%d, %d, %d, %d) at 1/%d: out of range", r.y0,
                     r.x0, r.y1, r.x1, r.shrink);
        return NULL;
    }
    if (r.y1 > JPEG_MAX_DIMENSION || r.x1 > JPEG_MAX_DIMENSION) {
        PyBuffer_Release(&view); /* in no JPEG (and its size times 3 could overflow) */
        Py_RETURN_NONE;
    }
    pixels = (long long)(r.y1 - r.y0) * (long long)(r.x1 - r.x0);
    if (pixels > max_pixels) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "window of %lld pixels, over the limit of %lld", pixels,
                     max_pixels);
        return NULL;
    }
    out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(pixels * 3));
    if (out == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    r.data = (const unsigned char *)view.buf;
    r.size = (size_t)view.len;
    r.out = (unsigned char *)PyByteArray_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    result = decode_window(&r, &err);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (result == DONE) return out;
    Py_DECREF(out);
    if (result == REFUSED) {
        PyErr_Format(PyExc_ValueError, "libjpeg: %s", err.message);
        return NULL;
    }
    if (result == NO_MEMORY) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *marker_after(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t start, found = -1;
    const unsigned char *data, *marker;
    (void)self;

    if (!PyArg_ParseTuple(args, "y*n", &view, &start)) return NULL;
    if (start >= 0 && start < view.len) {
        data = (const unsigned char *)view.buf;
        Py_BEGIN_ALLOW_THREADS
        marker = find_marker(data + start, data + view.len);
        Py_END_ALLOW_THREADS
        if (marker != NULL) found = marker - data;
    }
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(found);
}

static PyObject *version(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
#ifdef LIBJPEG_TURBO_VERSION
#define FASTDATA_STR(x) #x
#define FASTDATA_XSTR(x) FASTDATA_STR(x)
    return PyUnicode_FromString("libjpeg-turbo " FASTDATA_XSTR(LIBJPEG_TURBO_VERSION));
#else
    return PyUnicode_FromFormat("libjpeg %d", JPEG_LIB_VERSION);
#endif
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS, "A JPEG's window decoded alone (see the module's source)."},
    {"marker_after", marker_after, METH_VARARGS,
     "Where the first marker at or after an offset begins, or -1 (see the module's source)."},
    {"version", version, METH_NOARGS, "The libjpeg this module was built against."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_jpegwindow", "A JPEG's window decoded alone, with libjpeg-turbo.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__jpegwindow(void) {
    PyObject *m = PyModule_Create(&module);
#ifdef FASTDATA_AVX2
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) find_marker = find_marker_avx2;
#endif
    if (m != NULL && PyModule_AddIntConstant(m, "ABI", 2) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
