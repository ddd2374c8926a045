// The platform interface every protocol header and kernel body is written against, so that one
// source compiles for the GPU (device.cuh: inline PTX) and for the host (host.h: std::atomic_ref,
// one std::thread per simulated warp group), and the host build runs under the CPU test suite,
// ThreadSanitizer included.
//
// A platform P provides, as static functions on int64_t / int32_t cells in memory other agents see:
//   load_acquire(p), store_release(p, v)   the flag operations: a publish is a release store after
//                                          the data, a wait is an acquire load before reading it
//   load_relaxed(p), store_relaxed(p, v)   counters nobody synchronises on
//   atomic_add(p, v)  cas32(p, expected, v) fence()
//   now()             a clock in the unit of the deadlines the host passes (ns on the host, clock64
//                     cycles on the device)
//   relax(spins)      what a spinning agent does between polls
//   peer_exited(pids, peer)  whether the peer's process is gone (host; the device relies on deadlines)
// and a Group type: the agents that run one protocol role together (a warp group on the device, one
// thread on the host): lane(), lanes(), sync(), leader().
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MC_HD __host__ __device__ __forceinline__
#else
#define MC_HD inline
#endif
