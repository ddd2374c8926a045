/* Two-hop ("internode") normal-mode dispatch: one channel of the forwarding queues.
 *
 * Mirrors internode_rdma_send (the senders), internode_forward (the forwarder) and internode_nvl_recv
 * (the receivers) in csrc/cuda/kernels/internode.h. A rank is (node, local index). A token from source
 * rank (ns, l) to node n goes over RDMA to the forwarder (n, l), which copies it over NVLink into the
 * ring of every destination rank of node n named in the token's mask. This model has NS senders (the
 * source ranks (ns, l), one per source node), the forwarder of one node and its ND receivers.
 *
 * RDMA ring of sender i: RDMA_SLOTS slots and rtail[i] in the forwarder's memory; rhead[i] lives in the
 * SENDER's memory. Sender i writes a chunk of at most RDMA_CHUNK tokens into its local staging slots
 * (same geometry as the ring), once rhead[i] shows room, then puts them into the forwarder's ring and
 * signals rtail[i] (data, then signal). After its last chunk it drains: it waits until rhead[i] covers
 * all its tokens, so no remote write into its memory of this call is still under way when the call ends.
 * The forwarder takes the senders in order (all of sender 0's tokens, then sender 1's, ...), in batches
 * of at most NVL_CHUNK tokens; for each batch it checks the slots, copies the tokens for each receiver d
 * (ascending) into d's NVL ring once nhead[d] shows room, publishes ntail[d], and only then signals
 * rhead[i]. NVL ring of receiver d: NVL_SLOTS slots, ntail[d] (written by the forwarder) and nhead[d]
 * (written by d), all in d's buffer. Every counter is monotonic within a call: position p is slot
 * p % SLOTS.
 *
 * Remote (RDMA) writes are delayed: they are messages to a NIC process (one per sender, both
 * directions), which delivers them later, in order per direction, at a moment SPIN chooses. A put
 * plus its tail signal is one message: the NIC reads the sender's staging slots when it delivers (the
 * latest moment the hardware may read them), writes them into the ring, then sets rtail[i]. The
 * forwarder's rhead[i] signal is one message too. NVLink stores (ntail, nhead, NVL slots) and local
 * stores are immediate. A token is its id (TOKEN: call, sender, position; never 0); its mask is a
 * fixed function of the id (MASK), so the slot carries both. To keep the state space small, a sender's
 * chunk (wait, stage, post), the forwarder's check of a batch, its copy to one receiver (wait, copy,
 * ntail) and a receiver's read of one slot are each one atomic step.
 *
 * Checked: every RDMA slot the forwarder reads and every NVL slot a receiver reads holds the token
 * expected there (no overwrite before read, no stale read), and there is no invalid end state.
 *
 * CALLS > 1 runs calls back to back: each rank resets the counters in its own memory (sender i:
 * rhead[i]; forwarder: rtail[*]; receiver d: nhead[d], ntail[d]), then all meet in a barrier.
 *
 * Planted bugs: -DEARLY_RDMA_HEAD signals rhead[i] right after reading rtail[i], before forwarding the
 * batch (the sender overwrites slots not yet forwarded); -DNO_DRAIN (with CALLS=2) skips the sender's
 * drain (the forwarder's last rhead signal of a call lands after the sender's reset, so the next call
 * starts with a stale head); -DCHUNK_TOO_BIG lifts the NVL_CHUNK < NVL_SLOTS check (a batch with more
 * tokens for one receiver than its ring holds never finds room: deadlock).
 *
 * Sizes are set with spin -DNS=.. -DND=.. -DNUM_TOKENS=.. -DRDMA_SLOTS=.. -DRDMA_CHUNK=.. -DNVL_SLOTS=..
 * -DNVL_CHUNK=.. -DCALLS=..
 */
#ifndef NS
#define NS 2
#endif
#ifndef ND
#define ND 2
#endif
#ifndef NUM_TOKENS
#define NUM_TOKENS 3
#endif
#ifndef RDMA_SLOTS
#define RDMA_SLOTS 2
#endif
#ifndef RDMA_CHUNK
#define RDMA_CHUNK 1
#endif
#ifndef NVL_SLOTS
#define NVL_SLOTS 2
#endif
#ifndef NVL_CHUNK
#define NVL_CHUNK 1
#endif
#ifndef CALLS
#define CALLS 1
#endif

/* The sizes the kernel accepts (DeepEP's Config): RDMA_SLOTS is the ring's size after rounding up to a
 * multiple of RDMA_CHUNK. */
#if !(0 < RDMA_CHUNK && RDMA_CHUNK < RDMA_SLOTS && 2 * RDMA_CHUNK <= RDMA_SLOTS)
#error "needs 0 < RDMA_CHUNK < RDMA_SLOTS and RDMA_CHUNK <= RDMA_SLOTS / 2"
#endif
#if !defined(CHUNK_TOO_BIG) && !(0 < NVL_CHUNK && NVL_CHUNK < NVL_SLOTS)
#error "needs 0 < NVL_CHUNK < NVL_SLOTS"
#endif

#define ALL ((1 << ND) - 1)
/* Token k = i * NUM_TOKENS + j is sender i's token j; its id in call c (never 0). */
#define TOKEN(c, k) ((c) * NS * NUM_TOKENS + (k) + 1)
#define KEY(id) (((id) - 1) % (NS * NUM_TOKENS))
/* Its destination mask, never empty: (i + j) % 4 cycles ALL, 1, ALL, 2 (for ND = 1: 1 throughout), so
 * each receiver gets tokens from each sender, and runs of 3 tokens for one receiver exist. */
#define PHASE(k) (((k) / NUM_TOKENS + (k) % NUM_TOKENS) % 4)
#define MASK(k) (PHASE(k) == 1 || ND == 1 -> 1 : (PHASE(k) == 3 -> 2 : ALL))
#define HAS(k, d) ((MASK(k) >> (d)) & 1)

#define RECEIVER0 (NS + 1)
#define NIC0 (NS + 1 + ND)
#define PARTIES (NS + 1 + ND)

typedef Ring { byte slot[RDMA_SLOTS] };
typedef NvlRing { byte slot[NVL_SLOTS] };
Ring stage[NS];     /* sender i's staging slots (its memory) */
Ring ring[NS];      /* sender i's ring at the forwarder */
byte rtail[NS];     /* forwarder's memory, written by sender i's NIC */
byte rhead[NS];     /* sender i's memory, written by the forwarder's NIC */
NvlRing nvl[ND];    /* receiver d's ring */
byte ntail[ND];     /* receiver d's memory, written by the forwarder */
byte nhead[ND];     /* receiver d's memory, written by d, read by the forwarder */

/* In-flight remote writes: a put of positions [from, to) plus its tail signal; a head signal. Enough
 * room for every message of every call. */
chan to_forwarder[NS] = [NUM_TOKENS * CALLS] of { byte, byte };
chan to_sender[NS] = [NUM_TOKENS * CALLS] of { byte };

/* The barrier between calls (barrier.pml models the real one): arrivals over all calls. */
byte arrived;

inline barrier(c) {
  arrived++;
  (arrived >= PARTIES * (c + 1))
}

active [NS] proctype sender() {
  byte i = _pid;
  byte call, sent, n, p;
  for (call : 0 .. CALLS - 1) {
    sent = 0;
    do
    :: sent < NUM_TOKENS ->
       n = (RDMA_CHUNK < NUM_TOKENS - sent -> RDMA_CHUNK : NUM_TOKENS - sent);
       /* Room for n: the forwarder has forwarded everything up to sent + n - RDMA_SLOTS. Then stage
        * the n tokens, and post the put of the staged slots followed by the signal rtail = sent + n,
        * on one queue pair (delivered in that order). */
       atomic {
         (rhead[i] + RDMA_SLOTS >= sent + n) ->
         for (p : sent .. sent + n - 1) {
           stage[i].slot[p % RDMA_SLOTS] = TOKEN(call, i * NUM_TOKENS + p)
         }
         to_forwarder[i] ! sent, sent + n;
         sent = sent + n;
         n = 0; p = 0
       }
    :: else -> break
    od;
#ifndef NO_DRAIN
    /* Drain: the forwarder's last head signal has landed in this rank's memory. */
    (rhead[i] >= NUM_TOKENS);
#endif
    rhead[i] = 0;
    barrier(call)
  }
}

active proctype forwarder() {
  byte call, i, d, p, consumed, batch;
  byte k[ND], nsent[ND];
  for (call : 0 .. CALLS - 1) {
    for (i : 0 .. NS - 1) {
      consumed = 0;
      do
      :: consumed < NUM_TOKENS ->
         atomic {
           (rtail[i] > consumed) ->
           batch = (rtail[i] < consumed + NVL_CHUNK -> rtail[i] - consumed : NVL_CHUNK)
         }
#ifdef EARLY_RDMA_HEAD
         to_sender[i] ! consumed + batch;
#endif
         /* Read the batch: each slot holds the expected token; the tokens for each receiver (the id
          * carries the mask). */
         d_step {
           for (p : consumed .. consumed + batch - 1) {
             assert(ring[i].slot[p % RDMA_SLOTS] == TOKEN(call, i * NUM_TOKENS + p))
           }
           for (d : 0 .. ND - 1) {
             k[d] = 0;
             for (p : consumed .. consumed + batch - 1) {
               k[d] = k[d] + HAS(KEY(ring[i].slot[p % RDMA_SLOTS]), d)
             }
           }
           d = 0; p = 0
         }
         for (d : 0 .. ND - 1) {
           if
           :: k[d] > 0 ->
              /* Room for k[d] in d's ring; copy the batch's tokens for d (read again from the slots),
               * then publish ntail. */
              atomic {
                (nhead[d] + NVL_SLOTS >= nsent[d] + k[d]) ->
                for (p : consumed .. consumed + batch - 1) {
                  if
                  :: HAS(KEY(ring[i].slot[p % RDMA_SLOTS]), d) ->
                     nvl[d].slot[nsent[d] % NVL_SLOTS] = ring[i].slot[p % RDMA_SLOTS];
                     nsent[d]++
                  :: else
                  fi
                }
                ntail[d] = nsent[d];
                k[d] = 0; p = 0
              }
           :: else
           fi
         }
#ifndef EARLY_RDMA_HEAD
         /* Free the slots only once the batch is forwarded. */
         to_sender[i] ! consumed + batch;
#endif
         consumed = consumed + batch;
         batch = 0
      :: else -> break
      od
    }
    atomic {
      for (i : 0 .. NS - 1) {
        rtail[i] = 0
      }
      for (d : 0 .. ND - 1) {
        nsent[d] = 0
      }
      i = 0; d = 0; consumed = 0
    }
    barrier(call)
  }
}

active [ND] proctype receiver() {
  byte d = _pid - RECEIVER0;
  byte call, consumed, seen, expected, p, key;
  for (call : 0 .. CALLS - 1) {
    /* d's tokens: sender 0's with bit d in order, then sender 1's, ...; key walks them. */
    d_step {
      expected = 0;
      for (key : 0 .. NS * NUM_TOKENS - 1) {
        expected = expected + HAS(key, d)
      }
      key = 0
    }
    consumed = 0;
    do
    :: consumed < expected ->
       atomic { (ntail[d] > consumed) -> seen = ntail[d] }
       for (p : consumed .. seen - 1) {
         d_step {
           do
           :: HAS(key, d) -> break
           :: else -> key++
           od;
           assert(nvl[d].slot[p % NVL_SLOTS] == TOKEN(call, key));
           key++
         }
       }
       /* Free the slots only after reading them. */
       atomic { nhead[d] = seen; consumed = seen; seen = 0; p = 0 }
    :: else -> break
    od;
    atomic { nhead[d] = 0; ntail[d] = 0; key = 0; consumed = 0; expected = 0 }
    barrier(call)
  }
}

/* The NICs: deliver sender i's puts and tail signals, and the forwarder's head signals to sender i,
 * each in order, whenever SPIN chooses; they stop once every rank has left its last call and nothing
 * is left in flight. A write still in flight after the last call lands harmlessly here: what a late
 * write does to the next use of the memory is what CALLS=2 checks. */
active [NS] proctype nic() {
  byte i = _pid - NIC0;
  byte from, to, p;
  do
  :: d_step {
       to_forwarder[i] ? from, to;
       for (p : from .. to - 1) {
         ring[i].slot[p % RDMA_SLOTS] = stage[i].slot[p % RDMA_SLOTS]
       }
       rtail[i] = to;
       from = 0; to = 0; p = 0
     }
  :: d_step {
       to_sender[i] ? to;
       rhead[i] = to;
       to = 0
     }
  :: arrived == PARTIES * CALLS && len(to_forwarder[i]) == 0 && len(to_sender[i]) == 0 -> break
  od
}
