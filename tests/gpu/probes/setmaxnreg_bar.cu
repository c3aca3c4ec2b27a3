// Probe of ptx/setmaxnreg.cuh (setmaxnreg_dec<24>, setmaxnreg_inc<240>) and ptx/bar.cuh
// (bar_sync, bar_arrive with named barriers). sm_90a; run by tests/gpu/test_ptx_probes.py.
//
// Three warpgroups, the FA3 warp-specialized split (fa3/forward.cuh run()): warpgroup 0 gives
// registers away (24), warpgroups 1 and 2 take them (240); 24*128 + 2*240*128 <= 65536. Every
// thread then counts itself into roles[warpgroup]. Warpgroups 1 and 2 take turns like FA3's
// ping-pong consumers: barrier 1 + c is "consumer c's turn" (256 threads: 128 arrive, 128 sync);
// consumer 1 hands consumer 0 the first turn, each consumer appends its warpgroup id to `log` 4
// times (thread 0 of the warpgroup, atomicAdd on `counter` for the slot), and consumer 0 takes
// the one extra turn at the end so both barriers are balanced. Expected log: 1,2,1,2,1,2,1,2.
#include "fagen/ptx/bar.cuh"
#include "fagen/ptx/setmaxnreg.cuh"

extern "C" __global__ void __launch_bounds__(384, 1)
    probe_setmaxnreg_bar(int* counter, int* log, int* roles) {
    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        fagen::ptx::setmaxnreg_dec<24>();
        atomicAdd(&roles[0], 1);
    } else {
        fagen::ptx::setmaxnreg_inc<240>();
        atomicAdd(&roles[wg], 1);
        const int consumer = wg - 1;
        const bool leader = threadIdx.x % 128 == 0;
        if (consumer == 1) fagen::ptx::bar_arrive(1, 256);  // consumer 0 goes first
        for (int turn = 0; turn < 4; ++turn) {
            fagen::ptx::bar_sync(1 + consumer, 256);
            if (leader) {
                const int slot = atomicAdd(counter, 1);
                if (slot < 8) log[slot] = wg;
                __threadfence();
            }
            fagen::ptx::bar_arrive(1 + (1 - consumer), 256);
        }
        if (consumer == 0) fagen::ptx::bar_sync(1, 256);
    }
}
