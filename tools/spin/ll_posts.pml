/* Low-latency calls that agree in the data path: the shm transport's posts (moe_comm/transport/shm.py,
 * ShmTransport.post and _ShmPost), the protocol the call header rides on.
 *
 * Every rank posts call n (n = 1 .. N) into slot n % SLOTS of every rank, itself included, and receives
 * call n - 1 after it (two calls in flight, as with receive hooks). A post waits until
 * the receiver has consumed the post SLOTS calls back in that slot (flow control: consumed >= n - SLOTS),
 * writes its header and its rows there, then publishes arrived[slot][receiver][sender] = n (release).
 * A receive of call n waits, for every sender, until arrived == n exactly (a smaller value is an
 * earlier call: keep waiting; a larger one would be a later call, out of step), reads the header (the
 * call number the verdict judges) and the rows, and stores consumed = n for the slot.
 *
 * Checked: every receiver reads, from every sender, the header and rows of the call it receives (not
 * an older or newer one), and there is no invalid end state.
 * Planted bugs (each must be found):
 *   -DHEADER_AFTER_PUBLISH   the sender publishes before it writes the header (a stale header is judged)
 *   -DNO_FLOW_CONTROL        the sender does not wait for the slot to be consumed (it overwrites a post
 *                            the receiver has not read)
 *   -DSTALE_ACCEPTED         the receiver takes any published call (arrived >= 1) as the one it waits for
 *
 * Sizes are set with spin -DR=.. -DN=.. (SLOTS = 2: DeepEP's double buffering).
 */
#ifndef R
#define R 2
#endif
#ifndef N
#define N 3
#endif
#define SLOTS 2

typedef Cell { byte header[R]; byte rows[R]; byte arrived[R] };  /* indexed by sender */
typedef Slot { Cell at[R]; byte consumed[R] };                    /* indexed by receiver */
Slot slot[SLOTS];

inline post(n) {
  s = (n) % SLOTS;
  for (peer : 0 .. R - 1) {
#ifndef NO_FLOW_CONTROL
    (slot[s].consumed[peer] + SLOTS >= (n));
#endif
#ifdef HEADER_AFTER_PUBLISH
    slot[s].at[peer].rows[_pid] = (n);
    slot[s].at[peer].arrived[_pid] = (n);
    slot[s].at[peer].header[_pid] = (n);
#else
    slot[s].at[peer].header[_pid] = (n);
    slot[s].at[peer].rows[_pid] = (n);
    slot[s].at[peer].arrived[_pid] = (n);   /* publish (release) after the header and the rows */
#endif
  }
}

inline receive(n) {
  s = (n) % SLOTS;
  for (peer : 0 .. R - 1) {
#ifdef STALE_ACCEPTED
    (slot[s].at[_pid].arrived[peer] >= 1);
#else
    (slot[s].at[_pid].arrived[peer] == (n));
#endif
    assert(slot[s].at[_pid].header[peer] == (n));   /* the verdict judges this call's header */
    assert(slot[s].at[_pid].rows[peer] == (n))       /* and the rows read are this call's */
  }
  slot[s].consumed[_pid] = (n)
}

/* Two calls in flight, as with DeepEP's receive hooks: call n is posted before call n - 1 is received. */
active [R] proctype rank() {
  byte n, s, peer;
  for (n : 1 .. N + 1) {
    if
    :: n <= N -> post(n)
    :: else -> skip
    fi;
    if
    :: n >= 2 -> receive(n - 1)
    :: else -> skip
    fi
  }
}
