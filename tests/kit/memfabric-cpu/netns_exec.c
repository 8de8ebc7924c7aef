/* TEST-ONLY launcher: run a command in a network namespace of its own, with only loopback (up).
 *
 *     netns-exec COMMAND [ARGS...]
 *
 * memfabric-hybrid 1.3.0's HOST_TCP data path binds every Prefill engine's data port at
 * 127.0.0.1:11000, so two memfabric test runs on one host (two checkouts, CI beside a developer's
 * pytest) collide: the later Prefill fails with "Address already in use". Everything a test run
 * starts inherits this namespace, so its port 11000 (and its config stores, its Decode ports)
 * is its own, and no other run can hold it.
 *
 * As root: unshare(CLONE_NEWNET). Otherwise: a user namespace too, with this uid and gid mapped
 * to themselves (the command runs as the same user, not as root). Then loopback is brought up
 * (it starts down) and COMMAND is exec'd. Exits 125 with the reason if the namespace cannot be
 * made, 127 if COMMAND cannot be run.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <net/if.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

static int write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t len = (ssize_t)strlen(text), n = write(fd, text, (size_t)len);
    int saved = errno;
    close(fd);
    errno = saved;
    return n == len ? 0 : -1;
}

static int user_and_net_namespace(void) {
    uid_t uid = getuid();
    gid_t gid = getgid();
    char map[64];
    if (unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0) return -1;
    if (write_file("/proc/self/setgroups", "deny") != 0 && errno != ENOENT) return -1;
    snprintf(map, sizeof map, "%u %u 1\n", (unsigned)uid, (unsigned)uid);
    if (write_file("/proc/self/uid_map", map) != 0) return -1;
    snprintf(map, sizeof map, "%u %u 1\n", (unsigned)gid, (unsigned)gid);
    return write_file("/proc/self/gid_map", map);
}

static int loopback_up(void) {
    struct ifreq ifr;
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    memset(&ifr, 0, sizeof ifr);
    strncpy(ifr.ifr_name, "lo", IFNAMSIZ - 1);
    int rc = ioctl(fd, SIOCGIFFLAGS, &ifr);
    if (rc == 0) {
        ifr.ifr_flags |= IFF_UP;
        rc = ioctl(fd, SIOCSIFFLAGS, &ifr);
    }
    int saved = errno;
    close(fd);
    errno = saved;
    return rc;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s COMMAND [ARGS...]\n", argv[0]);
        return 125;
    }
    if (unshare(CLONE_NEWNET) != 0) {
        int first = errno;
        if (user_and_net_namespace() != 0) {
            fprintf(stderr,
                    "netns-exec: cannot make a network namespace: unshare(CLONE_NEWNET): %s; "
                    "with a user namespace: %s\n",
                    strerror(first), strerror(errno));
            return 125;
        }
    }
    if (loopback_up() != 0) {
        fprintf(stderr, "netns-exec: cannot bring loopback up in the new namespace: %s\n", strerror(errno));
        return 125;
    }
    execvp(argv[1], argv + 1);
    fprintf(stderr, "netns-exec: cannot run %s: %s\n", argv[1], strerror(errno));
    return 127;
}
