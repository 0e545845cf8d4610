/* The file store's per-page I/O loops (native.py builds this as an extension module).
   Each call takes a batch, holds the GIL only to read its arguments and build its results,
   and makes every system call of the batch with the GIL released. Semantics: io.py's
   write_value, read_value and count_present, page for page; results are raw codes that
   native.py turns into the same objects. crc32_values is framing.py's `checksums` for a
   batch, with the GIL released once for all of it; crc32_start / crc32_finish the same on a
   thread of its own. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef O_NOATIME
#define O_NOATIME 0
#endif

#define ABI 4
#define FIXED 24 /* "<4sHHQII": magic, version, key length, payload length, crc32, reserved */
#define VERSION 1
#define MARK_NS 424242LL
#define CHUNK (512 * 1024)

typedef uint32_t (*crc_fn)(uint32_t, const unsigned char *, uint64_t);
static crc_fn crc32_of = NULL;
static int iov_max = 1024;

typedef struct {
    char *ptr;
    Py_ssize_t len;
} piece_t;

/* ------------------------------------------------------------------ helpers (no GIL) */

static int make_dirs(const char *path) {
    /* mkdir -p, every directory made 0700; 0 or -1 with errno */
    if (mkdir(path, 0700) == 0 || errno == EEXIST) return 0;
    if (errno != ENOENT) return -1;
    size_t n = strlen(path);
    char *parent = malloc(n + 1);
    if (!parent) return -1;
    memcpy(parent, path, n + 1);
    char *slash = strrchr(parent, '/');
    if (!slash || slash == parent) {
        free(parent);
        errno = ENOENT;
        return -1;
    }
    *slash = 0;
    int rc = make_dirs(parent);
    free(parent);
    if (rc != 0) return -1;
    if (mkdir(path, 0700) == 0 || errno == EEXIST) return 0;
    return -1;
}

static int make_parent(const char *path) {
    size_t n = strlen(path);
    char *dir = malloc(n + 1);
    if (!dir) return -1;
    memcpy(dir, path, n + 1);
    char *slash = strrchr(dir, '/');
    int rc;
    if (!slash) {
        errno = ENOENT;
        rc = -1;
    } else {
        if (slash == dir) slash[1] = 0; else *slash = 0;
        rc = make_dirs(dir);
    }
    free(dir);
    return rc;
}

static int fsync_parent(const char *path) {
    size_t n = strlen(path);
    char *dir = malloc(n + 2);
    if (!dir) return -1;
    memcpy(dir, path, n + 1);
    char *slash = strrchr(dir, '/');
    if (!slash) strcpy(dir, ".");
    else if (slash == dir) slash[1] = 0;
    else *slash = 0;
    int fd = open(dir, O_RDONLY | O_CLOEXEC);
    free(dir);
    if (fd < 0) return -1;
    int rc = fsync(fd);
    int saved = errno;
    close(fd);
    errno = saved;
    return rc;
}

/* readv/writev of `iov` (cnt entries, consumed as they move) until all moved; for reads
   stops at end of file. Returns bytes moved, or -1 with errno. */
static int64_t vector_io(int fd, struct iovec *iov, int cnt, int reading) {
    int64_t total = 0;
    int i = 0;
    while (i < cnt && iov[i].iov_len == 0) i++;
    while (i < cnt) {
        int batch = cnt - i < iov_max ? cnt - i : iov_max;
        ssize_t n = reading ? readv(fd, iov + i, batch) : writev(fd, iov + i, batch);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (n == 0) {
            if (reading) break;
            errno = EIO;
            return -1;
        }
        total += n;
        while (n > 0 && i < cnt) {
            if ((size_t)n >= iov[i].iov_len) {
                n -= iov[i].iov_len;
                i++;
            } else {
                iov[i].iov_base = (char *)iov[i].iov_base + n;
                iov[i].iov_len -= n;
                n = 0;
            }
        }
        while (i < cnt && iov[i].iov_len == 0) i++;
    }
    return total;
}

/* The pieces' bytes [from, from + len) as iovecs appended at `out` (returns how many). */
static int iov_range(const piece_t *p, int np, int64_t from, int64_t len, struct iovec *out) {
    int k = 0;
    int64_t at = 0;
    for (int j = 0; j < np && len > 0; j++) {
        int64_t end = at + p[j].len;
        if (end > from) {
            int64_t off = from > at ? from - at : 0;
            int64_t take = p[j].len - off;
            if (take > len) take = len;
            out[k].iov_base = p[j].ptr + off;
            out[k].iov_len = (size_t)take;
            k++;
            from += take;
            len -= take;
        }
        at = end;
    }
    return k;
}

static uint32_t crc_range(const piece_t *p, int np, int64_t from, int64_t len, uint32_t crc) {
    int64_t at = 0;
    for (int j = 0; j < np && len > 0; j++) {
        int64_t end = at + p[j].len;
        if (end > from) {
            int64_t off = from > at ? from - at : 0;
            int64_t take = p[j].len - off;
            if (take > len) take = len;
            crc = crc32_of(crc, (const unsigned char *)p[j].ptr + off, (uint64_t)take);
            from += take;
            len -= take;
        }
        at = end;
    }
    return crc;
}

static void put_le(unsigned char *at, uint64_t v, int n) {
    for (int i = 0; i < n; i++) at[i] = (unsigned char)(v >> (8 * i));
}

static uint64_t get_le(const unsigned char *at, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = (v << 8) | at[i];
    return v;
}

static void pack_header(unsigned char *h, const char *key, Py_ssize_t klen, uint64_t payload,
                        uint32_t crc) {
    memcpy(h, "HKV\0", 4);
    put_le(h + 4, VERSION, 2);
    put_le(h + 6, (uint64_t)klen, 2);
    put_le(h + 8, payload, 8);
    put_le(h + 16, crc, 4);
    put_le(h + 20, 0, 4);
    memcpy(h + FIXED, key, (size_t)klen);
}

/* ------------------------------------------------------------------ writes */

typedef struct {
    const char *key;
    Py_ssize_t klen;
    const char *path;
    const char *temp;
    piece_t *pieces;
    int npieces;
    int fsync;
    int64_t atime_ns, mtime_ns;
    int set_times; /* 0: the kernel's own (a fresh file's atime is at most its mtime) */
    /* results */
    int64_t size, payload;
    int err;       /* 0, or the errno */
    int err_file;  /* 0 none, 1 temp, 2 temp -> path */
} wjob_t;

static void write_one(wjob_t *w, struct iovec *iov) {
    int64_t want = 0;
    for (int j = 0; j < w->npieces; j++) want += w->pieces[j].len;
    int64_t hsize = FIXED + w->klen;
    unsigned char *head = malloc((size_t)hsize);
    if (!head) {
        w->err = ENOMEM;
        return;
    }
    int fd = open(w->temp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0 && errno == ENOENT) {  /* the temporary directory was deleted: make it again */
        if (make_parent(w->temp) != 0) {
            w->err = errno;
            w->err_file = 1;
            free(head);
            return;
        }
        fd = open(w->temp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    }
    if (fd < 0) {
        w->err = errno;
        w->err_file = 1;
        free(head);
        return;
    }
    int failed = 0;
    if (want <= CHUNK) {  /* one chunk: checksum it, then header and payload in one call */
        uint32_t crc = crc_range(w->pieces, w->npieces, 0, want, 0);
        pack_header(head, w->key, w->klen, (uint64_t)want, crc);
        iov[0].iov_base = head;
        iov[0].iov_len = (size_t)hsize;
        int k = 1 + iov_range(w->pieces, w->npieces, 0, want, iov + 1);
        if (vector_io(fd, iov, k, 0) < 0) failed = 1;
    } else {  /* payload a chunk at a time right after checksumming it; the header last */
        uint32_t crc = 0;
        if (lseek(fd, hsize, SEEK_SET) < 0) failed = 1;
        for (int64_t at = 0; !failed && at < want; at += CHUNK) {
            int64_t len = want - at < CHUNK ? want - at : CHUNK;
            crc = crc_range(w->pieces, w->npieces, at, len, crc);
            int k = iov_range(w->pieces, w->npieces, at, len, iov);
            if (vector_io(fd, iov, k, 0) < 0) failed = 1;
        }
        if (!failed) {
            pack_header(head, w->key, w->klen, (uint64_t)want, crc);
            ssize_t n = pwrite(fd, head, (size_t)hsize, 0);
            if (n != hsize) {
                if (n >= 0) errno = EIO;
                failed = 1;
            }
        }
    }
    if (!failed && w->set_times) {
        struct timespec times[2];
        times[0].tv_sec = w->atime_ns / 1000000000LL;
        times[0].tv_nsec = w->atime_ns % 1000000000LL;
        times[1].tv_sec = w->mtime_ns / 1000000000LL;
        times[1].tv_nsec = w->mtime_ns % 1000000000LL;
        if (futimens(fd, times) != 0) failed = 1;  /* after the last write, which moves mtime */
    }
    if (!failed && w->fsync && fsync(fd) != 0) failed = 1;
    int saved = errno;
    if (close(fd) != 0 && !failed) {
        failed = 1;
        saved = errno;
    }
    free(head);
    if (!failed) {
        if (rename(w->temp, w->path) != 0) {
            if (errno == ENOENT && make_parent(w->path) == 0) {  /* shard directory not made yet */
                if (rename(w->temp, w->path) != 0) {
                    failed = 1;
                    w->err_file = 2;
                }
            } else {
                failed = 1;
                w->err_file = 2;
            }
            saved = errno;
        }
    }
    if (!failed && w->fsync && fsync_parent(w->path) != 0) {
        failed = 1;
        saved = errno;
    }
    if (failed) {
        w->err = saved ? saved : EIO;
        unlink(w->temp);
        return;
    }
    w->size = hsize + want;
    w->payload = want;
}

/* ------------------------------------------------------------------ reads */

enum { R_READ = 0, R_ABSENT, R_EXPIRED, R_HEADER, R_TRUNC_SIZE, R_LENGTH, R_TRUNC_READ,
       R_CHECKSUM, R_ERROR };

typedef struct {
    const char *key;
    Py_ssize_t klen;
    const char *path;
    piece_t *pieces;
    int npieces;
    int64_t now_ns;
    int64_t touch_before_ns; /* mtime is touched only when older than this */
    /* results */
    int code;
    int err;
    int64_t a, b;  /* R_READ: payload, file size; R_EXPIRED: file size; else detail numbers */
    int64_t atime_ns, mtime_ns;
    unsigned char *head;  /* R_HEADER: the header bytes read (hlen of them) */
    int64_t hlen;
} rjob_t;

static int64_t mod_ns(int64_t t) {
    int64_t m = t % 1000000LL;
    return m < 0 ? m + 1000000LL : m;
}

/* An atime with the expiry mark, later than mtime (index.py), whose deadline (atime - MARK_NS
   ns) is at most `expire_le` ns: expired (native.py computes `expire_le` from `now` exactly as
   Python compares). */
static int expired(int64_t atime, int64_t mtime, int64_t expire_le) {
    return mod_ns(atime) == MARK_NS && atime > mtime && atime - MARK_NS <= expire_le;
}

static void read_one(rjob_t *r, struct iovec *iov, int64_t expire_le) {
    int fd = open(r->path, O_RDONLY | O_CLOEXEC | O_NOATIME);
    if (fd < 0 && errno == EPERM) fd = open(r->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT) r->code = R_ABSENT;
        else {
            r->code = R_ERROR;
            r->err = errno;
            r->a = 1;  /* the open failed: the error names the file */
        }
        return;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        r->code = R_ERROR;
        r->err = errno;
        close(fd);
        return;
    }
    int64_t atime = (int64_t)st.st_atim.tv_sec * 1000000000LL + st.st_atim.tv_nsec;
    int64_t mtime = (int64_t)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
    r->atime_ns = atime;
    r->mtime_ns = mtime;
    if (expired(atime, mtime, expire_le)) {
        unlink(r->path);
        r->code = R_EXPIRED;
        r->a = (int64_t)st.st_size;
        close(fd);
        return;
    }
    int64_t want = 0;
    for (int j = 0; j < r->npieces; j++) want += r->pieces[j].len;
    int64_t hsize = FIXED + r->klen;
    unsigned char *head = malloc((size_t)hsize);
    if (!head) {
        r->code = R_ERROR;
        r->err = ENOMEM;
        close(fd);
        return;
    }
    int64_t first = want < CHUNK ? want : CHUNK;
    iov[0].iov_base = head;
    iov[0].iov_len = (size_t)hsize;
    int k = 1 + iov_range(r->pieces, r->npieces, 0, first, iov + 1);
    int64_t got = vector_io(fd, iov, k, 1);
    int corrupt = 0;
    if (got < 0) {
        r->code = R_ERROR;
        r->err = errno;
        goto done;
    }
    int64_t avail = got < hsize ? got : hsize;
    if (avail < FIXED || memcmp(head, "HKV\0", 4) != 0 || get_le(head + 4, 2) != VERSION ||
        avail < FIXED + (int64_t)get_le(head + 6, 2) || (int64_t)get_le(head + 6, 2) != r->klen ||
        memcmp(head + FIXED, r->key, (size_t)r->klen) != 0) {
        r->code = R_HEADER;  /* framing.decode_header says which (it raises) */
        r->head = head;
        r->hlen = avail;
        head = NULL;
        corrupt = 1;
        goto done;
    }
    int64_t payload_len = (int64_t)get_le(head + 8, 8);
    uint32_t want_crc = (uint32_t)get_le(head + 16, 4);
    if ((int64_t)st.st_size - hsize != payload_len) {
        r->code = R_TRUNC_SIZE;
        r->a = (int64_t)st.st_size - hsize;
        r->b = payload_len;
        corrupt = 1;
        goto done;
    }
    if (payload_len != want) {
        r->code = R_LENGTH;
        r->a = payload_len;
        r->b = want;
        corrupt = 1;
        goto done;
    }
    uint32_t crc = crc_range(r->pieces, r->npieces, 0, first, 0);
    for (int64_t at = first; at < want; at += CHUNK) {
        int64_t len = want - at < CHUNK ? want - at : CHUNK;
        int n = iov_range(r->pieces, r->npieces, at, len, iov);
        int64_t more = vector_io(fd, iov, n, 1);
        if (more < 0) {
            r->code = R_ERROR;
            r->err = errno;
            goto done;
        }
        got += more;
        crc = crc_range(r->pieces, r->npieces, at, len, crc);
    }
    if (got != hsize + want) {
        r->code = R_TRUNC_READ;
        r->a = got - hsize;
        r->b = want;
        corrupt = 1;
        goto done;
    }
    if (crc != want_crc) {
        r->code = R_CHECKSUM;
        corrupt = 1;
        goto done;
    }
    if (mtime < r->touch_before_ns) {
        struct timespec times[2];  /* recency for every process sharing the directory */
        times[0] = st.st_atim;
        times[1].tv_sec = r->now_ns / 1000000000LL;
        times[1].tv_nsec = r->now_ns % 1000000000LL;
        (void)futimens(fd, times);  /* a read-only store still serves reads */
    }
    r->code = R_READ;
    r->a = want;
    r->b = (int64_t)st.st_size;
done:
    if (corrupt) unlink(r->path);
    free(head);
    close(fd);
}

/* ------------------------------------------------------------------ argument handling */

static int get_pieces(PyObject *seq, int writable, Py_buffer **views, int *nviews,
                      piece_t **pieces, int *npieces) {
    PyObject *fast = PySequence_Fast(seq, "pieces must be a sequence");
    if (!fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    *pieces = PyMem_Calloc(n ? n : 1, sizeof(piece_t));
    *views = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    *npieces = 0;
    *nviews = 0;
    if (!*pieces || !*views) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, j);
        if (PyObject_GetBuffer(item, &(*views)[j], writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) != 0) {
            Py_DECREF(fast);
            return -1;
        }
        (*nviews)++;
        (*pieces)[j].ptr = (*views)[j].buf;
        (*pieces)[j].len = (*views)[j].len;
        (*npieces)++;
    }
    Py_DECREF(fast);
    return 0;
}

static void free_pieces(Py_buffer *views, int nviews, piece_t *pieces) {
    if (views) {
        for (int j = 0; j < nviews; j++) PyBuffer_Release(&views[j]);
        PyMem_Free(views);
    }
    PyMem_Free(pieces);
}

static const char *utf8(PyObject *s, Py_ssize_t *len) {
    if (!PyUnicode_Check(s)) {
        PyErr_SetString(PyExc_TypeError, "expected str");
        return NULL;
    }
    return PyUnicode_AsUTF8AndSize(s, len);
}

static struct iovec *alloc_iov(Py_ssize_t most_pieces) {
    /* a chunk or the whole value: at most every piece, plus the header */
    return malloc(sizeof(struct iovec) * (size_t)(most_pieces + 2));
}

/* A batch's per-job tables: the jobs, and the buffer views each job's pieces hold. */
typedef struct {
    void *jobs;
    Py_buffer **views;
    int *nviews;
} batch_t;

static int batch_alloc(batch_t *b, Py_ssize_t n, size_t job_size) {
    if (!crc32_of) {
        PyErr_SetString(PyExc_RuntimeError, "no checksum function set");
        return -1;
    }
    b->jobs = PyMem_Calloc(n ? n : 1, job_size);
    b->views = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer *));
    b->nviews = PyMem_Calloc(n ? n : 1, sizeof(int));
    if (!b->jobs || !b->views || !b->nviews) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void batch_free(batch_t *b) {
    PyMem_Free(b->jobs);
    PyMem_Free(b->views);
    PyMem_Free(b->nviews);
}

/* write_values(jobs) -> list of (size, payload) or (errno, which) */
static PyObject *write_values(PyObject *self, PyObject *args) {
    PyObject *jobs;
    if (!PyArg_ParseTuple(args, "O!", &PyList_Type, &jobs)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(jobs);
    batch_t batch = {0};
    PyObject *out = NULL;
    Py_ssize_t ready = 0, most = 0;
    int failed = batch_alloc(&batch, n, sizeof(wjob_t));
    wjob_t *w = batch.jobs;
    Py_buffer **views = batch.views;
    int *nviews = batch.nviews;
    if (failed) goto cleanup;
    for (; ready < n; ready++) {
        PyObject *job = PyList_GET_ITEM(jobs, ready);
        PyObject *key, *path, *temp, *pieces, *fsync, *times;
        long long at, mt;
        if (!PyTuple_Check(job) || PyTuple_GET_SIZE(job) != 6) {
            PyErr_SetString(PyExc_TypeError, "a write job is a 6-tuple");
            goto cleanup;
        }
        key = PyTuple_GET_ITEM(job, 0);
        path = PyTuple_GET_ITEM(job, 1);
        temp = PyTuple_GET_ITEM(job, 2);
        pieces = PyTuple_GET_ITEM(job, 3);
        fsync = PyTuple_GET_ITEM(job, 4);
        times = PyTuple_GET_ITEM(job, 5);
        wjob_t *wj = &w[ready];
        if (!(wj->key = utf8(key, &wj->klen)) || !(wj->path = utf8(path, NULL)) ||
            !(wj->temp = utf8(temp, NULL)))
            goto cleanup;
        if (wj->klen > 0xFFFF) {
            PyErr_Format(PyExc_ValueError, "key of %zd bytes is longer than 65535", wj->klen);
            goto cleanup;
        }
        if (times != Py_None) {
            if (!PyArg_ParseTuple(times, "LL", &at, &mt)) goto cleanup;
            wj->atime_ns = at;
            wj->mtime_ns = mt;
            wj->set_times = 1;
        }
        wj->fsync = PyObject_IsTrue(fsync);
        if (wj->fsync < 0) goto cleanup;
        if (get_pieces(pieces, 0, &views[ready], &nviews[ready], &wj->pieces, &wj->npieces) != 0) {
            ready++;
            goto cleanup;
        }
        if (wj->npieces > most) most = wj->npieces;
    }
    {
        struct iovec *iov = alloc_iov(most);
        if (!iov) {
            PyErr_NoMemory();
            goto cleanup;
        }
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) write_one(&w[i], iov);
        Py_END_ALLOW_THREADS
        free(iov);
    }
    out = PyList_New(n);
    if (!out) goto cleanup;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = w[i].err ? Py_BuildValue("(ii)", -w[i].err, w[i].err_file)
                                  : Py_BuildValue("(LL)", (long long)w[i].size, (long long)w[i].payload);
        if (!item) {
            Py_CLEAR(out);
            goto cleanup;
        }
        PyList_SET_ITEM(out, i, item);
    }
cleanup:
    if (!failed) {
        for (Py_ssize_t i = 0; i < ready; i++) free_pieces(views[i], nviews[i], w[i].pieces);
    }
    batch_free(&batch);
    return out;
}

/* read_values(jobs, expire_le) -> list of result tuples (see R_*) */
static PyObject *read_values(PyObject *self, PyObject *args) {
    PyObject *jobs;
    long long expire_le;
    if (!PyArg_ParseTuple(args, "O!L", &PyList_Type, &jobs, &expire_le)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(jobs);
    batch_t batch = {0};
    PyObject *out = NULL;
    Py_ssize_t ready = 0, most = 0;
    int failed = batch_alloc(&batch, n, sizeof(rjob_t));
    rjob_t *r = batch.jobs;
    Py_buffer **views = batch.views;
    int *nviews = batch.nviews;
    if (failed) goto cleanup;
    for (; ready < n; ready++) {
        PyObject *job = PyList_GET_ITEM(jobs, ready);
        if (!PyTuple_Check(job) || (PyTuple_GET_SIZE(job) != 5 && PyTuple_GET_SIZE(job) != 6)) {
            PyErr_SetString(PyExc_TypeError, "a read job is a 5- or 6-tuple");
            goto cleanup;
        }
        rjob_t *rj = &r[ready];
        long long now_ns;
        if (!(rj->key = utf8(PyTuple_GET_ITEM(job, 0), &rj->klen)) ||
            !(rj->path = utf8(PyTuple_GET_ITEM(job, 1), NULL)))
            goto cleanup;
        now_ns = PyLong_AsLongLong(PyTuple_GET_ITEM(job, 4));
        if (now_ns == -1 && PyErr_Occurred()) goto cleanup;
        rj->now_ns = now_ns;
        rj->touch_before_ns = INT64_MAX;
        if (PyTuple_GET_SIZE(job) == 6) {
            long long before = PyLong_AsLongLong(PyTuple_GET_ITEM(job, 5));
            if (before == -1 && PyErr_Occurred()) goto cleanup;
            rj->touch_before_ns = before;
        }
        if (get_pieces(PyTuple_GET_ITEM(job, 2), 1, &views[ready], &nviews[ready], &rj->pieces,
                       &rj->npieces) != 0) {
            ready++;
            goto cleanup;
        }
        if (rj->npieces > most) most = rj->npieces;
    }
    {
        struct iovec *iov = alloc_iov(most);
        if (!iov) {
            PyErr_NoMemory();
            goto cleanup;
        }
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) read_one(&r[i], iov, (int64_t)expire_le);
        Py_END_ALLOW_THREADS
        free(iov);
    }
    out = PyList_New(n);
    if (!out) goto cleanup;
    for (Py_ssize_t i = 0; i < n; i++) {
        rjob_t *rj = &r[i];
        PyObject *item;
        switch (rj->code) {
        case R_ABSENT:
            item = Py_NewRef(Py_None);
            break;
        case R_HEADER:
            item = Py_BuildValue("(iy#)", rj->code, (const char *)rj->head, (Py_ssize_t)rj->hlen);
            break;
        case R_ERROR:
            item = Py_BuildValue("(iiL)", rj->code, rj->err, (long long)rj->a);
            break;
        default:
            item = Py_BuildValue("(iLLLL)", rj->code, (long long)rj->a, (long long)rj->b,
                                 (long long)rj->atime_ns, (long long)rj->mtime_ns);
        }
        if (!item) {
            Py_CLEAR(out);
            goto cleanup;
        }
        PyList_SET_ITEM(out, i, item);
    }
cleanup:
    if (!failed) {
        for (Py_ssize_t i = 0; i < n; i++) free(r[i].head);
        for (Py_ssize_t i = 0; i < ready; i++) free_pieces(views[i], nviews[i], r[i].pieces);
    }
    batch_free(&batch);
    return out;
}

/* count_present(paths, expire_le) -> how many from the first exist and have not expired */
static PyObject *count_present(PyObject *self, PyObject *args) {
    PyObject *paths;
    long long expire_le;
    if (!PyArg_ParseTuple(args, "O!L", &PyList_Type, &paths, &expire_le)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(paths);
    const char **p = PyMem_Calloc(n ? n : 1, sizeof(char *));
    if (!p) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!(p[i] = utf8(PyList_GET_ITEM(paths, i), NULL))) {
            PyMem_Free(p);
            return NULL;
        }
    }
    Py_ssize_t count = 0;
    Py_BEGIN_ALLOW_THREADS
    for (; count < n; count++) {
        struct stat st;
        if (stat(p[count], &st) != 0) break;
        int64_t atime = (int64_t)st.st_atim.tv_sec * 1000000000LL + st.st_atim.tv_nsec;
        int64_t mtime = (int64_t)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
        if (expired(atime, mtime, (int64_t)expire_le)) break;
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(p);
    return PyLong_FromSsize_t(count);
}

/* ------------------------------------------------------------------ framing in memory */

#define FRAME_STEP (64 * 1024) /* copy then checksum a step at a time, while it is in cache */

/* Copy `len` bytes from `src` to `dst` a step at a time, each step checksummed from `dst`
   right after its copy. */
static uint32_t copy_crc(char *dst, const char *src, int64_t len, uint32_t crc) {
    for (int64_t at = 0; at < len; at += FRAME_STEP) {
        int64_t take = len - at < FRAME_STEP ? len - at : FRAME_STEP;
        memcpy(dst + at, src + at, (size_t)take);
        crc = crc32_of(crc, (const unsigned char *)dst + at, (uint64_t)take);
    }
    return crc;
}

typedef struct {
    const char *key;
    Py_ssize_t klen;
    piece_t *pieces;
    int npieces;
    int64_t want; /* payload bytes: the pieces' total */
    char *out;    /* frame_values: the value's bytes (header, key, payload) */
    /* unframe_values */
    Py_buffer value;
    int has_value;
    int code;
    int64_t a, b;
} fjob_t;

static void frame_one(fjob_t *f) {
    char *at = f->out + FIXED + f->klen;
    uint32_t crc = 0;
    for (int j = 0; j < f->npieces; j++) {
        crc = copy_crc(at, f->pieces[j].ptr, f->pieces[j].len, crc);
        at += f->pieces[j].len;
    }
    pack_header((unsigned char *)f->out, f->key, f->klen, (uint64_t)f->want, crc);
}

/* A framing job's key and its page's pieces (`writable`: a page read into), their total in
   `want`. 0; -1 (an exception set, nothing held) or -2 (an exception set, the pieces held:
   the caller releases them with the job's). */
static int job_page(batch_t *batch, fjob_t *job, Py_ssize_t i, PyObject *key, PyObject *page,
                    int writable) {
    if (!(job->key = utf8(key, &job->klen))) return -1;
    if (get_pieces(page, writable, &batch->views[i], &batch->nviews[i], &job->pieces,
                   &job->npieces) != 0)
        return -2;
    for (int j = 0; j < job->npieces; j++) job->want += job->pieces[j].len;
    return 0;
}

/* frame_values(keys, pages) -> one bytes object per page: framing.py's header (key, payload
   length, CRC-32) then the page's pieces, copied and checksummed with the GIL released. */
static PyObject *frame_values(PyObject *self, PyObject *args) {
    PyObject *keys, *pages;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &keys, &PyList_Type, &pages)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (PyList_GET_SIZE(pages) != n) {
        PyErr_SetString(PyExc_ValueError, "as many keys as pages are needed");
        return NULL;
    }
    batch_t batch = {0};
    PyObject *out = NULL;
    Py_ssize_t ready = 0;
    int failed = batch_alloc(&batch, n, sizeof(fjob_t));
    fjob_t *f = batch.jobs;
    if (failed) goto cleanup;
    out = PyList_New(n);
    if (!out) goto cleanup;
    for (; ready < n; ready++) {
        fjob_t *fj = &f[ready];
        int got = job_page(&batch, fj, ready, PyList_GET_ITEM(keys, ready),
                           PyList_GET_ITEM(pages, ready), 0);
        if (got < 0) {
            ready += got == -2; /* its pieces are held: released below */
            goto fail;
        }
        if (fj->klen > 0xFFFF) {
            PyErr_Format(PyExc_ValueError, "key of %zd bytes is longer than 65535", fj->klen);
            ready++;
            goto fail;
        }
        PyObject *value = PyBytes_FromStringAndSize(NULL, FIXED + fj->klen + fj->want);
        if (!value) {
            ready++;
            goto fail;
        }
        fj->out = PyBytes_AS_STRING(value);
        PyList_SET_ITEM(out, ready, value);
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) frame_one(&f[i]);
    Py_END_ALLOW_THREADS
    goto cleanup;
fail:
    Py_CLEAR(out);
cleanup:
    if (!failed) {
        for (Py_ssize_t i = 0; i < ready; i++)
            free_pieces(batch.views[i], batch.nviews[i], f[i].pieces);
    }
    batch_free(&batch);
    return out;
}

static void unframe_one(fjob_t *u) {
    const unsigned char *v = u->value.buf;
    int64_t len = u->value.len;
    int64_t hsize = FIXED + u->klen;
    int64_t avail = len < hsize ? len : hsize;
    if (avail < FIXED || memcmp(v, "HKV\0", 4) != 0 || get_le(v + 4, 2) != VERSION ||
        avail < FIXED + (int64_t)get_le(v + 6, 2) || (int64_t)get_le(v + 6, 2) != u->klen ||
        memcmp(v + FIXED, u->key, (size_t)u->klen) != 0) {
        u->code = R_HEADER; /* framing.decode_header says which */
        return;
    }
    int64_t payload_len = (int64_t)get_le(v + 8, 8);
    uint32_t want_crc = (uint32_t)get_le(v + 16, 4);
    if (len - hsize != payload_len) {
        u->code = R_TRUNC_SIZE;
        u->a = len - hsize;
        u->b = payload_len;
        return;
    }
    if (payload_len != u->want) {
        u->code = R_LENGTH;
        u->a = payload_len;
        u->b = u->want;
        return;
    }
    const char *at = (const char *)v + hsize;
    uint32_t crc = 0;
    for (int j = 0; j < u->npieces; j++) {
        crc = copy_crc(u->pieces[j].ptr, at, u->pieces[j].len, crc);
        at += u->pieces[j].len;
    }
    u->code = crc == want_crc ? R_READ : R_CHECKSUM;
    u->a = u->want;
}

/* unframe_values(keys, values, pages) -> per page None (its value is None), (R_READ, payload)
   or a code saying why the value is not that page's (R_HEADER: framing.decode_header of the
   value says which; R_TRUNC_SIZE and R_LENGTH with their two numbers; R_CHECKSUM). Each value
   is copied into its page's pieces and checksummed there, the GIL released; a page whose
   value fails may hold part of it. */
static PyObject *unframe_values(PyObject *self, PyObject *args) {
    PyObject *keys, *values, *pages;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyList_Type, &keys, &PyList_Type, &values,
                          &PyList_Type, &pages))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (PyList_GET_SIZE(values) != n || PyList_GET_SIZE(pages) != n) {
        PyErr_SetString(PyExc_ValueError, "as many keys as values and pages are needed");
        return NULL;
    }
    batch_t batch = {0};
    PyObject *out = NULL;
    Py_ssize_t ready = 0;
    int failed = batch_alloc(&batch, n, sizeof(fjob_t));
    fjob_t *u = batch.jobs;
    if (failed) goto cleanup;
    for (; ready < n; ready++) {
        fjob_t *uj = &u[ready];
        PyObject *value = PyList_GET_ITEM(values, ready);
        int got = job_page(&batch, uj, ready, PyList_GET_ITEM(keys, ready),
                           PyList_GET_ITEM(pages, ready), 1);
        if (got < 0) {
            ready += got == -2; /* its pieces are held: released below */
            goto cleanup;
        }
        if (value == Py_None) {
            uj->code = R_ABSENT;
            continue;
        }
        if (PyObject_GetBuffer(value, &uj->value, PyBUF_SIMPLE) != 0) {
            ready++;
            goto cleanup;
        }
        uj->has_value = 1;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (u[i].has_value) unframe_one(&u[i]);
    }
    Py_END_ALLOW_THREADS
    out = PyList_New(n);
    if (!out) goto cleanup;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = u[i].code == R_ABSENT
                             ? Py_NewRef(Py_None)
                             : Py_BuildValue("(iLL)", u[i].code, (long long)u[i].a, (long long)u[i].b);
        if (!item) {
            Py_CLEAR(out);
            goto cleanup;
        }
        PyList_SET_ITEM(out, i, item);
    }
cleanup:
    if (!failed) {
        for (Py_ssize_t i = 0; i < ready; i++) {
            if (u[i].has_value) PyBuffer_Release(&u[i].value);
            free_pieces(batch.views[i], batch.nviews[i], u[i].pieces);
        }
    }
    batch_free(&batch);
    return out;
}

/* ------------------------------------------------------------------ batch checksums */

/* A batch of values to checksum: each value's buffers, held until the job is released. */
typedef struct {
    Py_ssize_t n, ready;
    Py_ssize_t next; /* the next value to take (atomic: the job's thread and the waiter take) */
    Py_buffer **views;
    int *nviews;
    piece_t **pieces;
    int *npieces;
    uint32_t *crcs;
    pthread_t thread;
    int running; /* a thread computes the crcs; join it before reading them */
} crc_job_t;

/* Checksum the values not taken yet, one at a time. Run by the job's thread and by whoever
   waits for the job, so a thread that got no core early leaves the waiter at most one value
   to wait for. */
static void crc_job_run(crc_job_t *job) {
    for (;;) {
        Py_ssize_t i = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (i >= job->n) return;
        uint32_t crc = 0;
        for (int j = 0; j < job->npieces[i]; j++)
            crc = crc32_of(crc, (const unsigned char *)job->pieces[i][j].ptr,
                           (uint64_t)job->pieces[i][j].len);
        job->crcs[i] = crc;
    }
}

static void *crc_job_thread(void *arg) {
    crc_job_run(arg);
    return NULL;
}

/* Finish the job: take the values its thread has not, then wait for the thread (the GIL
   released meanwhile). pthread_join makes the thread's checksums visible here. */
static void crc_job_join(crc_job_t *job) {
    if (!job->running) return;
    Py_BEGIN_ALLOW_THREADS
    crc_job_run(job);
    pthread_join(job->thread, NULL);
    Py_END_ALLOW_THREADS
    job->running = 0;
}

/* Let go of the values' buffers, once the thread is done with them. */
static void crc_job_release(crc_job_t *job) {
    crc_job_join(job);
    if (job->views && job->nviews && job->pieces) {
        for (Py_ssize_t i = 0; i < job->ready; i++)
            free_pieces(job->views[i], job->nviews[i], job->pieces[i]);
    }
    job->ready = 0;
}

static void crc_job_free(crc_job_t *job) {
    if (!job) return;
    crc_job_release(job);
    PyMem_Free(job->views);
    PyMem_Free(job->nviews);
    PyMem_Free(job->pieces);
    PyMem_Free(job->npieces);
    PyMem_Free(job->crcs);
    PyMem_Free(job);
}

/* The job for `arg` (a sequence of values, each a sequence of buffers), its buffers taken. */
static crc_job_t *crc_job_new(PyObject *arg) {
    if (!crc32_of) {
        PyErr_SetString(PyExc_RuntimeError, "no checksum function set");
        return NULL;
    }
    PyObject *values = PySequence_Fast(arg, "values must be a sequence");
    if (!values) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(values), m = n ? n : 1;
    crc_job_t *job = PyMem_Calloc(1, sizeof(crc_job_t));
    if (!job) goto no_memory;
    job->n = n;
    job->views = PyMem_Calloc(m, sizeof(Py_buffer *));
    job->nviews = PyMem_Calloc(m, sizeof(int));
    job->pieces = PyMem_Calloc(m, sizeof(piece_t *));
    job->npieces = PyMem_Calloc(m, sizeof(int));
    job->crcs = PyMem_Calloc(m, sizeof(uint32_t));
    if (!job->views || !job->nviews || !job->pieces || !job->npieces || !job->crcs) goto no_memory;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *value = PySequence_Fast_GET_ITEM(values, i);
        job->ready = i + 1; /* its views so far are released with the job */
        if (get_pieces(value, 0, &job->views[i], &job->nviews[i], &job->pieces[i],
                       &job->npieces[i]) != 0) {
            crc_job_free(job);
            Py_DECREF(values);
            return NULL;
        }
    }
    Py_DECREF(values);
    return job;
no_memory:
    PyErr_NoMemory();
    crc_job_free(job);
    Py_DECREF(values);
    return NULL;
}

static PyObject *crc_job_results(crc_job_t *job) {
    PyObject *out = PyList_New(job->n);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < job->n; i++) {
        PyObject *item = PyLong_FromUnsignedLong(job->crcs[i]);
        if (!item) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, item);
    }
    return out;
}

/* crc32_values(values) -> the CRC-32 of each value, a sequence of buffers whose concatenation
   it checksums (framing.py's `checksums`). The buffers are held while the GIL is released once
   for the whole batch, so the checksums run beside threads that hold the GIL meanwhile. */
static PyObject *crc32_values(PyObject *self, PyObject *arg) {
    crc_job_t *job = crc_job_new(arg);
    if (!job) return NULL;
    Py_BEGIN_ALLOW_THREADS
    crc_job_run(job);
    Py_END_ALLOW_THREADS
    PyObject *out = crc_job_results(job);
    crc_job_free(job);
    return out;
}

#define CRC_JOB "hicache.crc32_job"

static void crc_job_capsule_free(PyObject *capsule) {
    crc_job_t *job = PyCapsule_GetPointer(capsule, CRC_JOB);
    if (job) __atomic_store_n(&job->next, job->n, __ATOMIC_RELAXED); /* nobody wants the rest */
    crc_job_free(job);
}

/* crc32_start(values) -> a job: crc32_values computed on a thread of its own, which never
   takes the GIL, so it runs beside a caller that holds the GIL (NIXL's binding does while its
   plugin copies). crc32_finish computes what the thread has not taken yet, then waits for it.
   The values' buffers are held until crc32_finish or the job is dropped. */
static PyObject *crc32_start(PyObject *self, PyObject *arg) {
    crc_job_t *job = crc_job_new(arg);
    if (!job) return NULL;
    if (job->n) {
        if (pthread_create(&job->thread, NULL, crc_job_thread, job) == 0) {
            job->running = 1;
        } else { /* no thread to be had: the caller's, now */
            Py_BEGIN_ALLOW_THREADS
            crc_job_run(job);
            Py_END_ALLOW_THREADS
        }
    }
    PyObject *capsule = PyCapsule_New(job, CRC_JOB, crc_job_capsule_free);
    if (!capsule) crc_job_free(job);
    return capsule;
}

/* crc32_finish(job) -> the CRC-32 of each value; the values' buffers are let go. */
static PyObject *crc32_finish(PyObject *self, PyObject *capsule) {
    crc_job_t *job = PyCapsule_GetPointer(capsule, CRC_JOB);
    if (!job) return NULL;
    crc_job_release(job);
    return crc_job_results(job);
}

static PyObject *set_crc(PyObject *self, PyObject *args) {
    unsigned long long addr;
    if (!PyArg_ParseTuple(args, "K", &addr)) return NULL;
    crc32_of = (crc_fn)(uintptr_t)addr;
    Py_RETURN_NONE;
}

static PyObject *abi(PyObject *self, PyObject *args) {
    return Py_BuildValue("(iii)", ABI, FIXED, CHUNK);
}

static PyMethodDef methods[] = {
    {"write_values", write_values, METH_VARARGS, NULL},
    {"read_values", read_values, METH_VARARGS, NULL},
    {"count_present", count_present, METH_VARARGS, NULL},
    {"crc32_values", crc32_values, METH_O, NULL},
    {"frame_values", frame_values, METH_VARARGS, NULL},
    {"unframe_values", unframe_values, METH_VARARGS, NULL},
    {"crc32_start", crc32_start, METH_O, NULL},
    {"crc32_finish", crc32_finish, METH_O, NULL},
    {"set_crc", set_crc, METH_VARARGS, NULL},
    {"abi", abi, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hicache_file_io", NULL, -1, methods};

PyMODINIT_FUNC PyInit__hicache_file_io(void) {
    long most = sysconf(_SC_IOV_MAX);
    iov_max = most > 0 && most < 1024 ? (int)most : 1024;
    return PyModule_Create(&module);
}
