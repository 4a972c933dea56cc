"""How much CPU a rank burns while its all-reduce waits for a late peer (tests/test_transport.py).

Rank 0 launches at once; the others arrive `late` seconds later. Prints, on rank 0,
`WAIT impl=<shm|mpi> op=<op> wall=<s> cpu=<s>`: the process's CPU time over the wait (its main
thread sleeps in `Handle.wait`, so this is the comm thread's)."""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from portddp.transport import MPITransport


def main():
    late = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    t = MPITransport()
    buf = t.empty(1 << 18, np.float32)
    for op in ("allreduce", "broadcast", "allreduce"):
        buf[...] = t.rank + 1
        t.barrier()
        if t.rank != 0:
            time.sleep(late)
        w0, c0 = time.perf_counter(), time.process_time()
        handle = t.allreduce(buf) if op == "allreduce" else t.broadcast(buf, root=1 % t.size)
        handle.wait(timeout=60)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        want = t.size * (t.size + 1) / 2 if op == "allreduce" else 1 % t.size + 1
        assert np.all(buf == want), (op, buf[:4], want)
        if t.rank == 0:
            os.write(1, f"WAIT impl={t.allreduce_impl} op={op} wall={wall:.4f} cpu={cpu:.4f}\n".encode())
    t.barrier()


if __name__ == "__main__":
    main()
