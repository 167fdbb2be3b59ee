# cython: language_level=3, boundscheck=False, wraparound=False
"""The KV subscriber's rounds over its sockets, in C: which have messages, then their messages.

Following 1,000 workers, pyzmq's own calls were a third of the subscriber thread: a poll of 1,000
sockets costs ~0.5 ms a round (``zmq_poll`` asks each socket for its descriptor and its events,
then polls them all), ``recv_multipart`` reads each frame and its ``RCVMORE`` through the Python
layer (~4 µs a three-frame message), and every drain ends in a raised ``zmq.Again`` (~3 µs). This
module takes readiness from an epoll set of the sockets' ``ZMQ_FD`` (a round costs what is ready,
not what is followed) and receives through libzmq's C API:

* The library is the one pyzmq loaded, found among the process's mappings and opened again with
  ``RTLD_NOLOAD`` (never a second copy: a socket belongs to the library instance that made it).
  Only when exactly one ``libzmq`` is mapped and its version is pyzmq's is it used; otherwise the
  import fails and the subscriber keeps pyzmq's ``Poller`` and ``recv_multipart``, the reference
  of what is received (``tests/exporter/sources/test_zmq_rounds.py`` holds the two to the same
  messages, frames and order).
* Sockets are pyzmq's (``Socket.underlying``), used only on the thread that owns them; closing one
  is pyzmq's, after which :meth:`Rounds.follow` must be told the sockets again before a poll.
* A message is its frames as ``bytes``, all of them (``zmq_msg_more``), so a malformed message
  reaches the subscriber's checks exactly as ``recv_multipart`` would give it.
* The wait is without the GIL. A receive that reads ``EAGAIN`` ends the drain (the socket is
  empty: its worker is caught up); ``EINTR`` is retried; any other error raises ``OSError``.
"""

from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdint cimport uintptr_t
from libc.stdlib cimport calloc, free
from libc.string cimport memset

import re

import zmq

cdef extern from *:
    """
    #include <dlfcn.h>
    #include <errno.h>
    typedef struct { unsigned char _[64]; } __attribute__((aligned(8))) pfx_zmq_msg_t;
    typedef int (*pfx_msg_f)(pfx_zmq_msg_t*);
    typedef int (*pfx_recv_f)(pfx_zmq_msg_t*, void*, int);
    typedef void* (*pfx_data_f)(pfx_zmq_msg_t*);
    typedef size_t (*pfx_size_f)(const pfx_zmq_msg_t*);
    typedef int (*pfx_more_f)(const pfx_zmq_msg_t*);
    typedef int (*pfx_errno_f)(void);
    typedef const char* (*pfx_strerror_f)(int);
    typedef void (*pfx_version_f)(int*, int*, int*);
    """
    ctypedef struct zmq_msg_t "pfx_zmq_msg_t":
        pass
    ctypedef int (*msg_f "pfx_msg_f")(zmq_msg_t*) nogil
    ctypedef int (*recv_f "pfx_recv_f")(zmq_msg_t*, void*, int) nogil
    ctypedef void* (*data_f "pfx_data_f")(zmq_msg_t*) nogil
    ctypedef size_t (*size_f "pfx_size_f")(const zmq_msg_t*) nogil
    ctypedef int (*more_f "pfx_more_f")(const zmq_msg_t*) nogil
    ctypedef int (*errno_f "pfx_errno_f")() nogil
    ctypedef const char* (*strerror_f "pfx_strerror_f")(int) nogil
    ctypedef void (*version_f "pfx_version_f")(int*, int*, int*) nogil
    void* dlopen(const char* path, int flags) nogil
    void* dlsym(void* handle, const char* name) nogil
    int RTLD_NOW, RTLD_NOLOAD
    int EAGAIN, EINTR
    int errno

cdef extern from "sys/epoll.h" nogil:
    ctypedef union epoll_data_t:
        void* ptr
        int fd
        unsigned int u32
    cdef struct epoll_event:
        unsigned int events
        epoll_data_t data
    int epoll_create1(int flags)
    int epoll_ctl(int epfd, int op, int fd, epoll_event* event)
    int epoll_wait(int epfd, epoll_event* events, int maxevents, int timeout)
    int EPOLLIN, EPOLL_CTL_ADD, EPOLL_CLOEXEC

cdef extern from "unistd.h" nogil:
    int close(int fd)

DEF ZMQ_DONTWAIT = 1

cdef msg_f _msg_init = NULL
cdef msg_f _msg_close = NULL
cdef recv_f _msg_recv = NULL
cdef data_f _msg_data = NULL
cdef size_f _msg_size = NULL
cdef more_f _msg_more = NULL
cdef errno_f _errno = NULL
cdef strerror_f _strerror = NULL

_LIBZMQ = re.compile(r"/libzmq[^/]*\.so[^/]*$")


def _mapped_libzmq() -> str:
    """The path of the one libzmq the process has mapped (pyzmq's); ImportError if none or several."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}
    except OSError as exc:  # no /proc (not Linux): pyzmq's calls
        raise ImportError(f"cannot read the process's mappings: {exc}") from exc
    found = sorted(p for p in paths if _LIBZMQ.search(p))
    if len(found) != 1:
        raise ImportError(f"expected one libzmq mapped in the process, found {len(found)}")
    return found[0]


cdef void* _sym(void* lib, bytes name) except NULL:
    cdef void* p = dlsym(lib, name)
    if p == NULL:
        raise ImportError(f"libzmq lacks {name.decode()}")
    return p


def _load() -> str:
    """Resolve the C API of pyzmq's libzmq; returns its path."""
    global _msg_init, _msg_close, _msg_recv, _msg_data, _msg_size, _msg_more, _errno, _strerror
    zmq.Context.instance()  # (pyzmq's backend, and with it libzmq, is loaded by ``import zmq``)
    path = _mapped_libzmq()
    cdef bytes bpath = path.encode()
    cdef void* lib = dlopen(bpath, RTLD_NOW | RTLD_NOLOAD)
    if lib == NULL:
        raise ImportError(f"{path} is mapped but not loaded as a library")
    cdef int major = 0, minor = 0, patch = 0
    (<version_f>_sym(lib, b"zmq_version"))(&major, &minor, &patch)
    if (major, minor, patch) != zmq.zmq_version_info():
        raise ImportError(f"{path} is libzmq {major}.{minor}.{patch}, pyzmq's is {zmq.zmq_version()}")
    _msg_init = <msg_f>_sym(lib, b"zmq_msg_init")
    _msg_close = <msg_f>_sym(lib, b"zmq_msg_close")
    _msg_recv = <recv_f>_sym(lib, b"zmq_msg_recv")
    _msg_data = <data_f>_sym(lib, b"zmq_msg_data")
    _msg_size = <size_f>_sym(lib, b"zmq_msg_size")
    _msg_more = <more_f>_sym(lib, b"zmq_msg_more")
    _errno = <errno_f>_sym(lib, b"zmq_errno")
    _strerror = <strerror_f>_sym(lib, b"zmq_strerror")
    return path


LIBZMQ = _load()


cdef OSError _error(str what):
    cdef int e = _errno()
    return OSError(e, f"{what}: {_strerror(e).decode(errors='replace')}")


cdef class Rounds:
    """The subscriber's SUB sockets: :meth:`poll` says which have messages, :meth:`drain` takes
    one's messages.

    Readiness comes from each socket's ``ZMQ_FD`` in an epoll set, so a round costs what is ready,
    not what is followed (``zmq_poll`` asks every socket: ~0.5 ms a round at 1,000 of them). That
    descriptor signals a change of the socket's state, not a message: it is reset only when libzmq
    reads the socket's commands, which a receive that finds the queue empty does. So a socket is
    polled again without waiting for its descriptor until a drain reads it empty: one stopped at
    its limit (or never drained since :meth:`follow`) is in the next round whatever epoll says.
    """

    cdef list _sockets   # the pyzmq sockets, kept alive while their handles are used
    cdef void** handles
    cdef char* queued    # per socket: in ``pending`` already
    cdef int* pending    # sockets to drain next round whatever their descriptor says
    cdef int npending
    cdef epoll_event* events
    cdef int n
    cdef int epfd

    def __cinit__(self):
        self._sockets = []
        self.handles, self.queued, self.pending, self.events = NULL, NULL, NULL, NULL
        self.n, self.npending, self.epfd = 0, 0, -1

    def __dealloc__(self):
        self._release()

    cdef void _release(self):
        free(self.handles)
        free(self.queued)
        free(self.pending)
        free(self.events)
        self.handles, self.queued, self.pending, self.events = NULL, NULL, NULL, NULL
        if self.epfd >= 0:
            close(self.epfd)
        self.epfd, self.n, self.npending = -1, 0, 0

    def follow(self, sockets) -> None:
        """The sockets to poll from now on, in order (:meth:`poll` answers their indexes); each is
        drained in the next round. Call it again before a poll once any of them is closed."""
        cdef list socks = list(sockets)
        cdef int n = len(socks), i, fd
        cdef epoll_event ev
        self._release()
        self._sockets = socks
        self.handles = <void**>calloc(n or 1, sizeof(void*))
        self.queued = <char*>calloc(n or 1, 1)
        self.pending = <int*>calloc(n or 1, sizeof(int))
        self.events = <epoll_event*>calloc(n or 1, sizeof(epoll_event))
        if not (self.handles and self.queued and self.pending and self.events):
            self._release()
            raise MemoryError()
        self.epfd = epoll_create1(EPOLL_CLOEXEC)
        if self.epfd < 0:
            self._release()
            raise OSError(errno, "epoll_create1")
        self.n = n
        for i in range(n):
            s = socks[i]
            self.handles[i] = <void*><uintptr_t>s.underlying
            fd = s.getsockopt(zmq.FD)
            memset(&ev, 0, sizeof(ev))
            ev.events = EPOLLIN
            ev.data.u32 = i
            if epoll_ctl(self.epfd, EPOLL_CTL_ADD, fd, &ev) < 0:
                e = errno
                self._release()
                raise OSError(e, f"epoll_ctl of socket {i}'s descriptor")
            self.queued[i] = 1
            self.pending[i] = i
        self.npending = n

    def poll(self, int timeout_ms) -> list:
        """Indexes of the sockets to drain this round, after waiting up to ``timeout_ms`` for one
        (no wait when a socket is still to be drained)."""
        cdef int got, i, k, np
        cdef list ready = []
        if self.n == 0:
            return ready
        if self.npending:
            timeout_ms = 0
        with nogil:
            got = epoll_wait(self.epfd, self.events, self.n, timeout_ms)
        if got < 0:
            if errno != EINTR:
                raise OSError(errno, "epoll_wait")
            got = 0
        np, self.npending = self.npending, 0
        for k in range(np):  # (``queued`` 2: answered this round, cleared below)
            i = self.pending[k]
            self.queued[i] = 2
            ready.append(i)
        for k in range(got):
            i = self.events[k].data.u32
            if i < self.n and not self.queued[i]:
                self.queued[i] = 2
                ready.append(i)
        for k in range(np):
            self.queued[self.pending[k]] = 0
        for k in range(got):
            i = self.events[k].data.u32
            if i < self.n:
                self.queued[i] = 0
        return ready

    def drain(self, int i, int limit) -> tuple:
        """Up to ``limit`` messages of socket ``i`` (each its list of frames) and whether it read
        empty (True: nothing is left in its receive queue; False: it is in the next round)."""
        cdef void* sock
        cdef list messages = []
        cdef list frames
        cdef zmq_msg_t msg
        cdef int k, rc
        if i < 0 or i >= self.n:
            raise IndexError(i)
        sock = self.handles[i]
        _msg_init(&msg)
        try:
            for k in range(limit):
                frames = []
                while True:
                    rc = _msg_recv(&msg, sock, ZMQ_DONTWAIT)
                    if rc < 0:
                        rc = _errno()
                        if rc == EINTR:
                            continue
                        if rc == EAGAIN and not frames:  # (a message's frames arrive together)
                            return messages, True
                        raise _error("zmq_msg_recv")
                    frames.append(PyBytes_FromStringAndSize(<char*>_msg_data(&msg), _msg_size(&msg)))
                    if not _msg_more(&msg):
                        break
                messages.append(frames)
            self._queue(i)
            return messages, False
        finally:
            _msg_close(&msg)

    def again(self, int i) -> None:
        """Drain socket ``i`` in the next round whatever its descriptor says (something else read
        its commands, and with them the signal)."""
        if i < 0 or i >= self.n:
            raise IndexError(i)
        self._queue(i)

    cdef void _queue(self, int i):
        if not self.queued[i]:
            self.queued[i] = 1
            self.pending[self.npending] = i
            self.npending += 1
