# C declarations of fast_path.py, which is written in Cython's pure-Python
# mode: read only when the module is compiled (see setup.py), never when it
# runs as Python. Names declared here are C variables, functions and fields of
# the compiled module (not attributes of it).

cimport cython
from libc.stdint cimport int64_t

cdef extern from *:
    """
    /* MPI_Iallreduce, MPI_Ibcast, MPI_Wait and MPI_Test of the MPI library mpi4py loaded,
       with MPICH's ABI (handles are C ints; MPI_IN_PLACE is (void *)-1 and
       MPI_STATUS_IGNORE (MPI_Status *)1): no mpi.h is needed to build this.
       fast_path.py checks the ABI on mpi4py's handles before loading them. */
    #include <dlfcn.h>
    #include <stddef.h>
    #include <sched.h>
    #include <time.h>
    #include <string.h>
    typedef int (*mpx_iallreduce_fn)(const void *, void *, int, int, int, int, int *);
    typedef int (*mpx_ibcast_fn)(void *, int, int, int, int, int *);
    typedef int (*mpx_wait_fn)(int *, void *);
    typedef int (*mpx_test_fn)(int *, int *, void *);
    static mpx_iallreduce_fn mpx_iallreduce_ptr = NULL;
    static mpx_ibcast_fn mpx_ibcast_ptr = NULL;
    static mpx_wait_fn mpx_wait_ptr = NULL;
    static mpx_test_fn mpx_test_ptr = NULL;

    /* library: the file of mpi4py's MPI module, already loaded; its symbols
       resolve to the MPI library it was loaded with. */
    static int mpx_mpi_load(const char *library) {
        void *lib = dlopen(library, RTLD_LAZY | RTLD_NOLOAD);
        if (lib == NULL) return 0;
        mpx_iallreduce_ptr = (mpx_iallreduce_fn)dlsym(lib, "MPI_Iallreduce");
        mpx_ibcast_ptr = (mpx_ibcast_fn)dlsym(lib, "MPI_Ibcast");
        mpx_wait_ptr = (mpx_wait_fn)dlsym(lib, "MPI_Wait");
        mpx_test_ptr = (mpx_test_fn)dlsym(lib, "MPI_Test");
        dlclose(lib);  /* drops the reference dlopen took; Python keeps its own */
        return mpx_iallreduce_ptr != NULL && mpx_ibcast_ptr != NULL && mpx_wait_ptr != NULL
            && mpx_test_ptr != NULL;
    }

    static int mpx_mpi_start(int bcast, size_t address, int count, unsigned int datatype,
                             unsigned int target, unsigned int comm, int *request) {
        if (bcast)
            return mpx_ibcast_ptr((void *)address, count, (int)datatype, (int)target,
                                  (int)comm, request);
        return mpx_iallreduce_ptr((const void *)-1, (void *)address, count, (int)datatype,
                                  (int)target, (int)comm, request);
    }

    static int mpx_mpi_wait(int *request) {
        return mpx_wait_ptr(request, (void *)1);
    }

    /* handle.wait_yielding in C: test 50 times, then test and sched_yield
       for 0.5 ms (the core goes to a runnable peer at once, and a peer that
       arrives meanwhile is seen at once), then test and sleep 20 us growing
       to 1 ms, so that an oversubscribed core goes to a rank that computes
       instead of to MPI_Wait's spinning. */
    static double mpx_monotonic(void) {
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        return (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
    }

    static int mpx_mpi_wait_yielding(int *request) {
        int flag = 0, spins = 0, err;
        long sleep_ns = 20000;
        double yield_until = 0.0;
        for (;;) {
            err = mpx_test_ptr(request, &flag, (void *)1);
            if (err != 0 || flag) return err;
            if (++spins == 51) yield_until = mpx_monotonic() + 500e-6;
            if (spins > 50 && mpx_monotonic() < yield_until) {
                sched_yield();
            } else if (spins > 50) {
                struct timespec pause = {0, sleep_ns};
                nanosleep(&pause, NULL);
                sleep_ns = sleep_ns * 3 / 2 < 1000000 ? sleep_ns * 3 / 2 : 1000000;
            }
        }
    }

    /* The call board's protocol (mpx.collectives.node.call_board) in C, on the same
       shared memory: slots of 8 int64 per rank and half, [0] the call's number
       (stored last, with release order), [1..6] its row. The fast path and, through
       the wrappers board_post .. board_wait, the general path's CallBoard run it. */
    static void mpx_board_post(long long *slots, int me, long long number, long long op,
                               long long dtype, long long count, long long reduce,
                               long long root, long long configuration) {
        long long *slot = slots + ((long long)me * 2 + (number & 1)) * 8;
        slot[1] = op; slot[2] = dtype; slot[3] = count; slot[4] = reduce; slot[5] = root;
        slot[6] = configuration;
        __atomic_store_n(&slot[0], number, __ATOMIC_RELEASE);
    }

    /* Whether every rank has posted call `number` (one look, no wait). */
    static int mpx_board_arrived(long long *slots, int size, long long number) {
        const long long half = number & 1;
        int p;
        for (p = 0; p < size; p++)
            if (__atomic_load_n(&slots[((long long)p * 2 + half) * 8], __ATOMIC_ACQUIRE) < number)
                return 0;
        return 1;
    }

    /* Whether every rank's row of call `number` equals this rank's (all have posted it). */
    static int mpx_board_same(long long *slots, int size, int me, long long number) {
        const long long half = number & 1;
        const long long *mine = slots + ((long long)me * 2 + half) * 8;
        int p, i;
        for (p = 0; p < size; p++) {
            const long long *slot = slots + ((long long)p * 2 + half) * 8;
            for (i = 1; i < 7; i++)
                if (slot[i] != mine[i]) return 0;
        }
        return 1;
    }

    /* Waits until the int64 at `word` reaches `number`. The wait spins, then
       sched_yields; a yielding communicator's (an oversubscribed host) sleeps
       after 0.5 ms, 20 us growing to 1 ms, like mpx_mpi_wait_yielding. The call
       board (every rank has posted call `number`) and shm's flags wait so. */
    static void mpx_wait_reaches(long long *word, long long number, int yielding) {
        int spins = 0;
        long sleep_ns = 20000;
        double yield_until = 0.0;
        while (__atomic_load_n(word, __ATOMIC_ACQUIRE) < number) {
            if (++spins == 51) yield_until = mpx_monotonic() + 500e-6;
            if (spins <= 50) continue;
            if (!yielding || mpx_monotonic() < yield_until) {
                sched_yield();
            } else {
                struct timespec pause = {0, sleep_ns};
                nanosleep(&pause, NULL);
                sleep_ns = sleep_ns * 3 / 2 < 1000000 ? sleep_ns * 3 / 2 : 1000000;
            }
        }
    }

    static void mpx_board_wait(long long *slots, int size, long long number, int yielding) {
        const long long half = number & 1;
        int p;
        for (p = 0; p < size; p++)
            mpx_wait_reaches(slots + ((long long)p * 2 + half) * 8, number, yielding);
    }

    /* mpx_board_wait, then mpx_board_same: 1 when all agree, 0 when any differs. */
    static int mpx_board_meet(long long *slots, int size, int me, long long number,
                              int yielding) {
        mpx_board_wait(slots, size, number, yielding);
        return mpx_board_same(slots, size, me, number);
    }
    /* The flag-based shared-memory allreduce of small messages
       (mpx.collectives.node.shm_flags; DeepSpeed's CPU shm allreduce does the same):
       rank p's part of one shared window starts at bases[p] with its flag (an
       int64) in the first cache line, then two buffers of `buffer` bytes. Call
       s copies the tensor into buffer s & 1 in pieces of MPX_FLAGS_PIECE bytes;
       after piece k it stores s << MPX_FLAGS_SHIFT | k + 1 in the flag
       (release); piece k is summed, every rank's buffer in rank order (the
       same bits on every rank), once every flag reads >= that (acquire). The
       pieces pipeline the copy, the wait and the sum: a piece is summed while
       it is still in the caches its copy warmed, and a rank sums the first
       piece while its peers still copy the last. A rank overwrites buffer s & 1
       again at call s + 2, after it has seen every peer post all of s + 1,
       which a peer starts only after it has summed all of call s: one wait a
       piece, no second barrier. `reached` below is a call's last flag value:
       s << MPX_FLAGS_SHIFT | its number of pieces. */
    #define MPX_FLAGS_HEADER 64
    #define MPX_FLAGS_SHIFT 20
    #define MPX_FLAGS_PIECE (128 << 10)

    static long long mpx_flags_pieces(size_t nbytes) {
        return nbytes ? (long long)((nbytes + MPX_FLAGS_PIECE - 1) / MPX_FLAGS_PIECE) : 1;
    }

    /* Posts the whole call at once (the general path); its `reached`. */
    static long long mpx_flags_post(const long long *bases, int me, long long buffer,
                                    size_t src, size_t nbytes) {
        long long *flag = (long long *)(size_t)bases[me];
        long long number = (*flag >> MPX_FLAGS_SHIFT) + 1;
        long long reached = number << MPX_FLAGS_SHIFT | mpx_flags_pieces(nbytes);
        memcpy((char *)flag + MPX_FLAGS_HEADER + (number & 1) * buffer, (const void *)src, nbytes);
        __atomic_store_n(flag, reached, __ATOMIC_RELEASE);
        return reached;
    }

    static int mpx_flags_arrived(const long long *bases, int size, long long reached) {
        int p;
        for (p = 0; p < size; p++)
            if (__atomic_load_n((long long *)(size_t)bases[p], __ATOMIC_ACQUIRE) < reached)
                return 0;
        return 1;
    }

    /* Waits until every rank's flag reads >= `reached` (mpx_wait_reaches). */
    static void mpx_flags_wait(const long long *bases, int size, long long reached,
                               int yielding) {
        int p;
        for (p = 0; p < size; p++)
            mpx_wait_reaches((long long *)(size_t)bases[p], reached, yielding);
    }

    /* dst[i] = src[0][i] + ... + src[size - 1][i], in blocks that stay in L1.
       Integers add with wraparound (the module is built with -fwrapv, and
       MPI and torch wrap alike). */
    #define MPX_FLAGS_SUM(type)                                                         \
        {                                                                               \
            type *out = (type *)dst;                                                    \
            size_t lo, i;                                                               \
            int p;                                                                      \
            for (lo = 0; lo < count; lo += 2048) {                                      \
                size_t hi = lo + 2048 < count ? lo + 2048 : count;                      \
                const type *a = (const type *)src[0], *b = (const type *)src[1];        \
                for (i = lo; i < hi; i++) out[i] = a[i] + b[i];                         \
                for (p = 2; p < size; p++) {                                            \
                    const type *c = (const type *)src[p];                               \
                    for (i = lo; i < hi; i++) out[i] += c[i];                           \
                }                                                                       \
            }                                                                           \
        }

    /* dtype: 0 float32, 1 float64, 2 int32, 3 int64 (shm_flags.CODES). */
    static void mpx_flags_sum(const char **src, int size, size_t dst, size_t count, int dtype) {
        switch (dtype) {
        case 0: MPX_FLAGS_SUM(float) break;
        case 1: MPX_FLAGS_SUM(double) break;
        case 2: MPX_FLAGS_SUM(int) break;
        default: MPX_FLAGS_SUM(long long) break;
        }
    }

    /* Sums the buffers of the call whose last flag is `reached` into dst. */
    static void mpx_flags_reduce(const long long *bases, int size, long long buffer,
                                 long long reached, size_t dst, size_t count, int dtype) {
        const char *src[64];
        long long half = (reached >> MPX_FLAGS_SHIFT) & 1;
        int p;
        for (p = 0; p < size; p++)
            src[p] = (const char *)(size_t)bases[p] + MPX_FLAGS_HEADER + half * buffer;
        mpx_flags_sum(src, size, dst, count, dtype);
    }

    /* The whole call, piece by piece (the fast path), in two parts: the first
       piece is posted under the package's lock (calls post in one order, as
       the general path's do), the rest after it, without the lock: a wait
       never holds it (the progress thread may need it to serve a peer). The
       tensor at `address` is the source and the result: piece k of it is
       copied out before it is summed into, and no later piece is touched
       before its copy. The window is the call's until it returns (MPI's rule:
       one thread's collectives on a communicator at a time). */
    static long long mpx_flags_first(const long long *bases, int me, long long buffer,
                                     size_t address, size_t nbytes) {
        long long *flag = (long long *)(size_t)bases[me];
        long long number = (*flag >> MPX_FLAGS_SHIFT) + 1;
        size_t len = nbytes < MPX_FLAGS_PIECE ? nbytes : MPX_FLAGS_PIECE;
        memcpy((char *)flag + MPX_FLAGS_HEADER + (number & 1) * buffer, (const void *)address, len);
        __atomic_store_n(flag, number << MPX_FLAGS_SHIFT | 1, __ATOMIC_RELEASE);
        return number;
    }

    static void mpx_flags_rest(const long long *bases, int me, int size, long long buffer,
                               long long number, size_t address, size_t nbytes, size_t count,
                               int dtype, int yielding) {
        long long *flag = (long long *)(size_t)bases[me];
        long long half = number & 1, k;
        size_t item = nbytes / count, lo, len;
        const char *src[64];
        int p;
        char *mine = (char *)flag + MPX_FLAGS_HEADER + half * buffer;
        for (k = 0, lo = 0; lo < nbytes; k++, lo += len) {
            long long reached = number << MPX_FLAGS_SHIFT | (k + 1);
            len = nbytes - lo < MPX_FLAGS_PIECE ? nbytes - lo : MPX_FLAGS_PIECE;
            if (k > 0) {
                memcpy(mine + lo, (const char *)address + lo, len);
                __atomic_store_n(flag, reached, __ATOMIC_RELEASE);
            }
            for (p = 0; p < size; p++) {
                if (p != me)
                    mpx_wait_reaches((long long *)(size_t)bases[p], reached, yielding);
                src[p] = (const char *)(size_t)bases[p] + MPX_FLAGS_HEADER + half * buffer + lo;
            }
            mpx_flags_sum(src, size, address + lo, len / item, dtype);
        }
    }
    """
    int mpx_mpi_load(const char *library)
    int mpx_mpi_start(bint bcast, size_t address, int count, unsigned int datatype,
                      unsigned int target, unsigned int comm, int *request) nogil
    int mpx_mpi_wait(int *request) nogil
    int mpx_mpi_wait_yielding(int *request) nogil
    void mpx_board_post(long long *slots, int me, long long number, long long op,
                        long long dtype, long long count, long long reduce, long long root,
                        long long configuration)
    int mpx_board_arrived(long long *slots, int size, long long number)
    int mpx_board_same(long long *slots, int size, int me, long long number)
    void mpx_board_wait(long long *slots, int size, long long number, int yielding) nogil
    int mpx_board_meet(long long *slots, int size, int me, long long number,
                       int yielding) nogil
    long long mpx_flags_post(const long long *bases, int me, long long buffer,
                             size_t src, size_t nbytes) nogil
    int mpx_flags_arrived(const long long *bases, int size, long long number) nogil
    void mpx_flags_wait(const long long *bases, int size, long long number, int yielding) nogil
    void mpx_flags_reduce(const long long *bases, int size, long long buffer, long long number,
                          size_t dst, size_t count, int dtype) nogil
    long long mpx_flags_first(const long long *bases, int me, long long buffer,
                              size_t address, size_t nbytes) nogil
    void mpx_flags_rest(const long long *bases, int me, int size, long long buffer,
                        long long number, size_t address, size_t nbytes, size_t count,
                        int dtype, int yielding) nogil

cdef object _TENSOR
cdef object _IN_PLACE
cdef object _acquire
cdef object _release
cdef long long _SLOT
cdef long long _payload

cdef class _Call:
    cdef bint bcast
    cdef Py_ssize_t nbytes
    cdef object dtype
    cdef object op
    cdef object impl
    cdef Py_ssize_t root
    cdef object start
    cdef tuple args
    cdef object queue
    cdef long long *board
    cdef bint direct
    cdef bint yielding
    cdef size_t address
    cdef Py_ssize_t count
    cdef unsigned int datatype
    cdef unsigned int target
    cdef unsigned int comm
    cdef bint checked
    cdef object board_obj
    cdef object row_obj
    cdef long long r_op
    cdef long long r_dtype
    cdef long long r_count
    cdef long long r_reduce
    cdef long long r_root
    cdef int node_rank
    cdef int node_size
    cdef long long *slots
    cdef long long *counter
    cdef bint flags
    cdef int code
    cdef int rank
    cdef int size

@cython.locals(call=_Call)
cdef _Call _lookup(object comm, object t, bint bcast, object op, object impl, Py_ssize_t root)

@cython.locals(err=cython.int, request=cython.int, n=cython.longlong, same=cython.int,
               bases=cython.p_longlong, buffer=cython.longlong, number=cython.longlong)
cdef bint _run_now(object comm, _Call call, object t) except -1

@cython.locals(call=_Call)
cpdef bint allreduce(object t, object op, object comm, object impl) except -1

@cython.locals(call=_Call)
cpdef bint broadcast(object t, object root, object comm, object impl) except -1

# The call board's protocol for mpx.collectives.node.call_board.CallBoard (addresses as ints).
@cython.locals(counted=cython.p_longlong, n=cython.longlong)
cpdef long long board_post(size_t slots, size_t counter, int me, const int64_t[::1] row) except -1
cpdef bint board_arrived(size_t slots, int size, long long number)
cpdef bint board_same(size_t slots, int size, int me, long long number)
cpdef void board_wait(size_t slots, int size, long long number, bint yielding)

# shm's flag-based allreduce for mpx.collectives.node.shm_flags (addresses as ints).
@cython.locals(table=cython.p_longlong, number=cython.longlong)
cpdef long long flags_post(size_t bases, int me, long long buffer, size_t src, size_t nbytes) except -1
cpdef bint flags_arrived(size_t bases, int size, long long number)
@cython.locals(table=cython.p_longlong)
cpdef void flags_wait(size_t bases, int size, long long number, bint yielding)
@cython.locals(table=cython.p_longlong)
cpdef void flags_reduce(size_t bases, int size, long long buffer, long long number, size_t dst,
                        size_t count, int code)
