// Shared-memory flags and process liveness: the synchronisation of the shm transport
// (moe_comm/transport/shm.py), implemented in flags.cpp. No torch or pybind11 types, as in api.h.
#pragma once

#include <cstdint>

#include "../common/codes.h"

namespace moe_comm::cpu {

// A sender publishes data with a release store after writing it; a receiver that sees the value
// with an acquire load also sees the data.
void flag_store(int64_t* flag, int64_t value);
int64_t flag_load(const int64_t* flag);

// Whether process `pid` runs on this host (an exited, unreaped process counts as dead).
bool process_alive(int64_t pid);

// How flags_wait ended (csrc/common/codes.h): kReached, every flag reached its target; kTimeout,
// timeout_s passed first; kPeerExited, the process that sets the flag not reached has exited;
// kPastTarget, (exact) the flag is already past its target: its setter is out of step.
using WaitOutcome = ::moe_comm::WaitOutcome;

// Waits until *flags[i] >= targets[i] (== with `exact`) for every i, polling, then yielding, then
// sleeping in short naps. Every 20 ms it checks the deadline and whether pids[i] (the process that
// sets flag i; <= 0: not checked) still runs. Returns -1 with *outcome = kReached when every flag is
// reached; otherwise the index of a flag not reached, with *outcome saying why the wait stopped.
int64_t flags_wait(int64_t* const* flags, const int64_t* targets, const int64_t* pids, int64_t n,
                   double timeout_s, bool exact, WaitOutcome* outcome);

}  // namespace moe_comm::cpu
