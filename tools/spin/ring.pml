/* Ring of one (channel, source rank) in normal-mode dispatch/combine.
 *
 * One sender writes NUM_TOKENS tokens, at most CHUNK at a time, into RING_SIZE slots that live in the
 * receiver's buffer; the receiver drains them. head (written by the receiver) and tail (written by the
 * sender) are monotonic: they never wrap, a position maps to slot position % RING_SIZE.
 *
 * Checked: every slot the receiver reads holds the token it expects (no overwrite before read, no stale
 * read), and there is no invalid end state (both loops finish). With CHUNK > RING_SIZE the sender can
 * never find CHUNK free slots: the model then deadlocks, as the kernel would.
 *
 * CALLS > 1 runs calls back to back: after its last read the receiver resets head and tail to 0, then
 * both sides meet in a barrier before the next call.
 *
 * Planted bugs: -DFREE_OFF_BY_ONE counts one free slot too many (the sender overwrites a slot not yet
 * read); -DRESET_AFTER_BARRIER resets after the barrier, when the sender may already have published
 * the next call's tail (lost, so the receiver waits forever).
 *
 * Sizes are set with spin -DRING_SIZE=.. -DCHUNK=.. -DNUM_TOKENS=.. -DCALLS=..
 */
#ifndef RING_SIZE
#define RING_SIZE 4
#endif
#ifndef CHUNK
#define CHUNK 2
#endif
#ifndef NUM_TOKENS
#define NUM_TOKENS 7
#endif
#ifndef CALLS
#define CALLS 1
#endif

/* Token id of position p in call c; never 0, so a slot nobody wrote reads as stale. */
#define TOKEN(c, p) ((c) * NUM_TOKENS + (p) + 1)

#ifdef FREE_OFF_BY_ONE
#define FREE(sent) (RING_SIZE + 1 - ((sent) - head))
#else
#define FREE(sent) (RING_SIZE - ((sent) - head))
#endif

byte slot[RING_SIZE];
byte head, tail;
/* The barrier between calls (barrier.pml models the real one): arrivals of both sides, over all calls. */
byte arrived;

inline barrier(c) {
  arrived++;
  (arrived >= 2 * (c + 1))
}

inline reset() {
  head = 0;
  tail = 0
}

active proctype sender() {
  byte call, sent, n, i;
  for (call : 0 .. CALLS - 1) {
    sent = 0;
    do
    :: sent < NUM_TOKENS ->
       n = (CHUNK < NUM_TOKENS - sent -> CHUNK : NUM_TOKENS - sent);
       /* Wait for n free slots: one read of head, as the kernel polls it. */
       (FREE(sent) >= n);
       for (i : 0 .. n - 1) {
         slot[(sent + i) % RING_SIZE] = TOKEN(call, sent + i)
       }
       /* Publish (release): the slots above are written before tail covers them. */
       tail = sent + n;
       sent = sent + n
    :: else -> break
    od;
    barrier(call)
  }
}

active proctype receiver() {
  byte call, consumed, seen, i;
  for (call : 0 .. CALLS - 1) {
    consumed = 0;
    do
    :: consumed < NUM_TOKENS ->
       (tail > consumed);
       seen = tail;   /* read again: covers the kernel keeping the value its wait saw (tail only grows) */
       for (i : consumed .. seen - 1) {
         assert(slot[i % RING_SIZE] == TOKEN(call, i))
       }
       /* Free the slots only after reading them. */
       head = seen;
       consumed = seen
    :: else -> break
    od;
#ifdef RESET_AFTER_BARRIER
    barrier(call);
    reset()
#else
    reset();
    barrier(call)
#endif
  }
}
