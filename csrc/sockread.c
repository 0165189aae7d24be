/* lmcache._sockread: read a socket into a buffer until it is full, with the GIL released.
 *
 * Optional CPython extension built by setup.py; lmcache/v1/storage_backend/connector/resp.py
 * falls back to a Python recv_into loop when it is missing (same bytes, same errors).
 *
 * Why: the remote tier reads multi-MiB values (one KV chunk is ~12 MB for the project's real
 * model) in recv_into calls of ~200 KB each. Every call releases the GIL for the system call
 * and must take it back afterwards; while another thread of the process holds it (vLLM's step
 * loop beside an asynchronous prefetch) each return waits for that thread's switch interval.
 * One call here releases the GIL once for the whole value (`lmcache bench remote` compares
 * the two readers, alone and beside a thread that keeps the GIL busy; docs/remote.md).
 *
 *   recv_exact(fd, buffer, timeout) -> int
 *       fd: a connected socket's descriptor (blocking or not: the loop polls).
 *       buffer: a writable contiguous buffer; it is filled from its start.
 *       timeout: seconds for the whole call (> 0).
 *       Returns len(buffer), or fewer bytes when the peer closed the connection first.
 *       Raises TimeoutError when the time runs out, OSError for a socket error.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>

static double monotonic_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static PyObject* recv_exact(PyObject* self, PyObject* args) {
  (void)self;
  int fd;
  Py_buffer view;
  double timeout;
  if (!PyArg_ParseTuple(args, "iw*d", &fd, &view, &timeout)) return NULL;
  if (!(timeout > 0)) {
    PyBuffer_Release(&view);
    PyErr_SetString(PyExc_ValueError, "timeout: expected seconds > 0");
    return NULL;
  }
  char* buf = (char*)view.buf;
  const Py_ssize_t want = view.len;
  Py_ssize_t got = 0;
  int err = 0;
  Py_BEGIN_ALLOW_THREADS
  const double deadline = monotonic_s() + timeout;
  while (got < want) {
    ssize_t k = recv(fd, buf + got, (size_t)(want - got), MSG_DONTWAIT);
    if (k > 0) {
      got += k;
      continue;
    }
    if (k == 0) break; /* the peer closed the connection */
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      err = errno;
      break;
    }
    const double left = deadline - monotonic_s();
    if (left <= 0) {
      err = ETIMEDOUT;
      break;
    }
    struct pollfd pfd = {fd, POLLIN, 0};
    const int ms = left > 3600.0 ? 3600 * 1000 : (int)(left * 1000.0) + 1;
    if (poll(&pfd, 1, ms) < 0 && errno != EINTR) {
      err = errno;
      break;
    }
  }
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&view);
  if (err == ETIMEDOUT) {
    PyErr_SetString(PyExc_TimeoutError, "socket read timed out");
    return NULL;
  }
  if (err != 0) {
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
  }
  return PyLong_FromSsize_t(got);
}

static PyMethodDef methods[] = {
    {"recv_exact", recv_exact, METH_VARARGS,
     "recv_exact(fd, buffer, timeout) -> bytes read: fill buffer from the socket, GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sockread", NULL, -1, methods};

PyMODINIT_FUNC PyInit__sockread(void) { return PyModule_Create(&module); }
