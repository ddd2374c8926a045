/* Low-latency dispatch/combine: the double buffer and its count signals.
 *
 * Call n of every rank uses half n % HALVES (HALVES = 2). Per half and per (receiver d, sender s) pair,
 * d's half holds the payload data[half][d][s] and a count signal, 0 = empty. Call n of sender s writes
 * its payload for d, then sets the signal to -(count + 1) (release), which is non-zero even for count 0.
 * Receiver d waits, for every s, until the signal is non-zero, reads the payload and resets the signal
 * to 0. Each rank sends to every rank (itself included) then receives from every rank, for calls
 * 0 .. N - 1. The payload of call n is modelled as the value n + 1 (so 0 reads as never written); the
 * count as 0, the one case an unencoded signal would confuse with empty.
 *
 * Checked: the receiver reads the current call's payload, not an older or newer call's, and there is no
 * invalid end state. -DHALVES=1 plants the bug of a single buffer: a fast sender's next call then
 * overwrites data, or its signal, before the receiver has read it.
 *
 * Sizes are set with spin -DR=.. -DN=.. -DHALVES=..
 */
#ifndef R
#define R 2
#endif
#ifndef N
#define N 3
#endif
#ifndef HALVES
#define HALVES 2
#endif

typedef Pair { byte data[R]; short signal[R] };   /* indexed by sender */
typedef Half { Pair recv[R] };                     /* indexed by receiver */
Half half[HALVES];

active [R] proctype rank() {
  byte n, h, peer;
  for (n : 0 .. N - 1) {
    h = n % HALVES;
    for (peer : 0 .. R - 1) {
      half[h].recv[peer].data[_pid] = n + 1;
      /* Publish (release) after the payload; count 0 still signals -1. */
      half[h].recv[peer].signal[_pid] = -(0 + 1)
    }
    for (peer : 0 .. R - 1) {
      (half[h].recv[_pid].signal[peer] != 0);
      assert(half[h].recv[_pid].data[peer] == n + 1);
      /* Empty the slot for the call that reuses this half. */
      half[h].recv[_pid].signal[peer] = 0
    }
  }
}
