/* The CUDA kernels' low-latency calls with their call headers (csrc/cuda/kernels/low_latency.h: the
 * host build runs them for the cuda_host backend): the agreement in the data path, in the kernels.
 *
 * Call n (n = 1 .. N) uses buffer half h = (n - 1) % 2. A send of call n, to every rank d (itself
 * included): waits until d has consumed call n - 2 of half h (flow control: the "consumed" cell d signals
 * into the sender's buffer), writes its header into d's header cell of h, publishes the cell's sequence
 * word = n (release), writes its rows, publishes its count signal = n (release). A receive of call n
 * waits, for every sender, until the sequence word is n exactly (an earlier call's: keep waiting; a later
 * one: out of step, asserted never to happen), judges the header; then waits until the count is n
 * exactly, reads the rows, zeroes the count (a replayed CUDA graph waits for a fresh one); then tells
 * every sender that it consumed call n of half h.
 *
 * Checked: every receiver judges the header and reads the rows of the call it receives, from every
 * sender, and no invalid end state (no rank left waiting: a later call's signal where an earlier one is
 * awaited would leave the exact wait blocked).
 * Planted bugs (each must be found):
 *   -DHEADER_AFTER_PUBLISH   the sequence word is published before the header is written
 *   -DROWS_AFTER_SIGNAL      the count is published before the rows are written
 *   -DNO_FLOW_CONTROL        the send does not wait for call n - 2 to be consumed
 *   -DSTALE_ACCEPTED         the receive takes any published call (>= 1) as the one it waits for
 *
 * Two calls in flight, as with DeepEP's receive hooks (call n is sent before call n - 1 is received).
 * Sizes: spin -DR=.. -DN=..
 */
#ifndef R
#define R 2
#endif
#ifndef N
#define N 3
#endif

typedef Cell { byte header[R]; byte seq[R]; byte rows[R]; byte count[R] };  /* indexed by sender */
typedef Half { Cell at[R]; byte consumed[R] };                             /* indexed by receiver */
Half half[2];

inline send(n) {
  h = ((n) - 1) % 2;
  for (peer : 0 .. R - 1) {
#ifndef NO_FLOW_CONTROL
    (half[h].consumed[peer] + 2 >= (n));
#endif
#ifdef HEADER_AFTER_PUBLISH
    half[h].at[peer].seq[_pid] = (n);
    half[h].at[peer].header[_pid] = (n);
#else
    half[h].at[peer].header[_pid] = (n);
    half[h].at[peer].seq[_pid] = (n);        /* publish (release) after the header */
#endif
  }
  for (peer : 0 .. R - 1) {
#ifdef ROWS_AFTER_SIGNAL
    half[h].at[peer].count[_pid] = (n);
    half[h].at[peer].rows[_pid] = (n);
#else
    half[h].at[peer].rows[_pid] = (n);
    half[h].at[peer].count[_pid] = (n);      /* publish (release) after the rows */
#endif
  }
}

inline receive(n) {
  h = ((n) - 1) % 2;
  for (peer : 0 .. R - 1) {
#ifdef STALE_ACCEPTED
    (half[h].at[_pid].seq[peer] >= 1);
#else
    (half[h].at[_pid].seq[peer] == (n));
#endif
    assert(half[h].at[_pid].header[peer] == (n))   /* the verdict judges this call's header */
  }
  for (peer : 0 .. R - 1) {
#ifdef STALE_ACCEPTED
    (half[h].at[_pid].count[peer] >= 1);
#else
    (half[h].at[_pid].count[peer] == (n));
#endif
    assert(half[h].at[_pid].rows[peer] == (n));     /* the rows read are this call's */
    half[h].at[_pid].count[peer] = 0
  }
  half[h].consumed[_pid] = (n)
}

active [R] proctype rank() {
  byte n, h, peer;
  for (n : 1 .. N + 1) {
    if
    :: n <= N -> send(n)
    :: else -> skip
    fi;
    if
    :: n >= 2 -> receive(n - 1)
    :: else -> skip
    fi
  }
}
