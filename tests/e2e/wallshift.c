/* LD_PRELOAD shim: CLOCK_REALTIME (+ gettimeofday, time) shifted by the offset in seconds
   read from $WALLSHIFT_FILE (re-read at most every 100 ms); monotonic clocks untouched. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <sys/time.h>
static int (*real_cg)(clockid_t, struct timespec *);
static double offset; static struct timespec last_read;
static double get_offset(void) {
    struct timespec m; const char *path = getenv("WALLSHIFT_FILE");
    if (!real_cg) real_cg = dlsym(RTLD_NEXT, "clock_gettime");
    if (!path) return 0;
    real_cg(CLOCK_MONOTONIC, &m);
    if ((m.tv_sec - last_read.tv_sec) * 1e9 + (m.tv_nsec - last_read.tv_nsec) > 1e8) {
        FILE *f = fopen(path, "r"); double v;
        if (f) { if (fscanf(f, "%lf", &v) == 1) offset = v; fclose(f); }
        last_read = m;
    }
    return offset;
}
int clock_gettime(clockid_t id, struct timespec *ts) {
    if (!real_cg) real_cg = dlsym(RTLD_NEXT, "clock_gettime");
    int rc = real_cg(id, ts);
    if (rc == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) {
        double off = get_offset(); long long ns = (long long)(off * 1e9);
        long long t = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + ns;
        ts->tv_sec = t / 1000000000LL; ts->tv_nsec = t % 1000000000LL;
    }
    return rc;
}
int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts; int rc = clock_gettime(CLOCK_REALTIME, &ts);
    if (tv) { tv->tv_sec = ts.tv_sec; tv->tv_usec = ts.tv_nsec / 1000; }
    (void)tz; return rc;
}
time_t time(time_t *t) {
    struct timespec ts; clock_gettime(CLOCK_REALTIME, &ts);
    if (t) *t = ts.tv_sec; return ts.tv_sec;
}
