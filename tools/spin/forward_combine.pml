/* Two-hop ("internode") normal-mode combine: one channel of the forwarding queues, the reverse of
 * forward.pml.
 *
 * Mirrors internode_combine_send (the returners), internode_combine_forward (the forwarders) and
 * internode_combine_recv (the final receivers) in csrc/cuda/kernels/internode.h. Source rank i (one per
 * source node, NS of them) dispatched token t to some nodes and, within node n, to some of its ranks.
 * In combine each of those ranks (returner (n, d)) sends its row of t back over NVLink to the forwarder
 * of node n, which sums the rows of t and sends the partial sum over RDMA to source i, which adds up
 * the partials of the nodes. This model has NS sources and NN destination nodes, each with its
 * forwarder; node 0 has ND returners, every other node ND_REST. With the defaults (NS = 1, NN = 2,
 * ND = 2, ND_REST = 1, NUM_TOKENS = 3) the source waits on partials from 2 forwarders (tokens 0 and 2)
 * and forwarder 0 sums rows from 2 returners.
 *
 * NVL ring of returner (n, d): NVL_SLOTS slots, ntail and nhead, all in forwarder n's buffer. Returner
 * (n, d) sends its rows source by source, in token order, in chunks of at most NVL_CHUNK, each once
 * nhead shows room, then publishes ntail. RDMA ring (n, i): RDMA_SLOTS slots and rtail in source i's
 * memory, rhead in FORWARDER n's memory. Forwarder n takes the sources in order; source i's tokens
 * routed to node n go in batches of at most RDMA_CHUNK: once rhead shows room for the batch, for each
 * token it waits for the row of each returner of the token in turn, checks it (the sum), then frees
 * the rows' slots (nhead) and writes the partial into its staging slot; at the end of the batch it puts
 * the staged slots into source i's ring and signals rtail. After its last batch it drains: it waits
 * until each rhead it owns covers all it sent, so no remote write into its memory is still under way
 * when the call ends. Source i walks its tokens in order and, for each node of the token (ascending),
 * reads the partial at the token's position in that node's ring. It publishes its heads lazily, as the
 * kernel does: after a read, once RDMA_CHUNK reads of that ring are unpublished; before a wait (the
 * tail, checked once, does not cover the position yet) every pending head; at the end every pending
 * head. Counters are monotonic (one call): position p is slot p % SLOTS.
 *
 * Remote (RDMA) writes are delayed as in forward.pml: messages to a NIC process (one per (node, source)
 * pair, both directions), delivered later, in order per direction, at a moment SPIN chooses. A put plus
 * its tail signal is one message; the NIC reads the staging slots when it delivers. A head signal is
 * one message. NVLink stores and local stores are immediate. A row or partial is its token's id
 * (TOKEN, never 0). To keep the state space small, a returner's chunk, a forwarder's work on one token
 * and a source's read of one partial are each one atomic step but where they wait; within them the
 * order is the kernel's (read a row, then free its slot). -DEARLY_NVL_HEAD runs the forwarder's token
 * without that atomic step.
 *
 * Checked: every row a forwarder reads and every partial a source reads is the expected one (no
 * overwrite before read, no stale read), and there is no invalid end state. One call (no CALLS): the
 * reset between calls and the drain's part in it are checked by forward.pml.
 *
 * The heads published before a wait are not needed for progress here: -DNO_PUBLISH_BEFORE_WAIT
 * (publish only at RDMA_CHUNK pending and at the end) finds no error either (e.g. RDMA_SLOTS=4
 * RDMA_CHUNK=2, NUM_TOKENS 3 to 5; so no test plants it). When source i waits at position pos
 * of ring (n, i) it has read everything before pos, so forwarder n has sent exactly pos and needs
 * rhead >= pos + k - RDMA_SLOTS, k <= RDMA_CHUNK. At most RDMA_CHUNK - 1 heads are unpublished, so the
 * head it gets (once delivered) is >= pos - RDMA_CHUNK + 1, enough as RDMA_CHUNK <= RDMA_SLOTS / 2.
 * Even beyond the accepted sizes (-DANY_RDMA_CHUNK, e.g. RDMA_SLOTS = RDMA_CHUNK = 2) SPIN finds no
 * error: batches start at multiples of RDMA_CHUNK, where the lazy rule leaves nothing unpublished.
 * A wait never spans nodes in a cycle: forwarders take the sources in the same order and a returner
 * waits on its own forwarder only.
 *
 * Planted bug: -DEARLY_NVL_HEAD frees a returner's slot (nhead) before reading the row in it: the
 * returner overwrites it.
 *
 * Sizes are set with spin -DNS=.. -DNN=.. -DND=.. -DND_REST=.. -DNUM_TOKENS=.. -DRDMA_SLOTS=..
 * -DRDMA_CHUNK=.. -DNVL_SLOTS=.. -DNVL_CHUNK=..
 */
#ifndef NS
#define NS 1
#endif
#ifndef NN
#define NN 2
#endif
#ifndef ND
#define ND 2
#endif
#ifndef ND_REST
#define ND_REST 1
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

/* The sizes the kernel accepts (DeepEP's Config): RDMA_SLOTS is the ring's size after rounding up to a
 * multiple of RDMA_CHUNK. -DANY_RDMA_CHUNK relaxes the RDMA check to 0 < RDMA_CHUNK <= RDMA_SLOTS. */
#if !defined(ANY_RDMA_CHUNK) && !(0 < RDMA_CHUNK && RDMA_CHUNK < RDMA_SLOTS && 2 * RDMA_CHUNK <= RDMA_SLOTS)
#error "needs 0 < RDMA_CHUNK < RDMA_SLOTS and RDMA_CHUNK <= RDMA_SLOTS / 2"
#endif
#if !(0 < RDMA_CHUNK && RDMA_CHUNK <= RDMA_SLOTS)
#error "needs 0 < RDMA_CHUNK <= RDMA_SLOTS"
#endif
#if !(0 < ND_REST && ND_REST <= ND)
#error "needs 0 < ND_REST <= ND"
#endif
#if !(0 < NVL_CHUNK && NVL_CHUNK < NVL_SLOTS)
#error "needs 0 < NVL_CHUNK < NVL_SLOTS"
#endif

/* Token k = i * NUM_TOKENS + t is source i's token t; its id (never 0). */
#define TOKEN(k) ((k) + 1)
/* Its nodes and, within a node, its returners: both for even i + t, node 0 (returner 0) only for odd
 * (for NN = 1 or ND = 1: the one there is). With the defaults, tokens 0 and 2 go to both returners of
 * both nodes, token 1 to returner 0 of node 0: ring (0, 0) gets 3 partials, returner (0, 0) 3 rows. */
#define MASK(i, t, count) (((i) + (t)) % 2 == 0 -> (1 << (count)) - 1 : 1)
#define TO_NODE(i, t, n) ((MASK(i, t, NN) >> (n)) & 1)
#define ND_OF(n) ((n) == 0 -> ND : ND_REST)
#define TO_RET(i, t, n, d) (TO_NODE(i, t, n) & ((MASK(i, t, ND_OF(n)) >> (d)) & 1))

#define FORWARDER0 NS
#define RETURNER0 (NS + NN)
#define RETURNERS (ND + (NN - 1) * ND_REST)
#define NIC0 (NS + NN + RETURNERS)
#define PARTIES (NS + NN + RETURNERS)

typedef Ring { byte slot[RDMA_SLOTS] };
typedef NvlRing { byte slot[NVL_SLOTS] };
typedef NodeRings { Ring r[NS] };
typedef NodeCounters { byte c[NS] };
typedef NodeNvlRings { NvlRing r[ND] };
typedef NodeNvlCounters { byte c[ND] };
NodeRings stage[NN];          /* stage[n].r[i]: forwarder n's staging slots for source i (its memory) */
NodeRings ring[NN];           /* ring[n].r[i]: ring (n, i), in source i's memory */
NodeCounters rtail[NN];       /* source i's memory, written by the NIC of (n, i) */
NodeCounters rhead[NN];       /* forwarder n's memory, written by the NIC of (n, i) */
NodeNvlRings nvl[NN];         /* nvl[n].r[d]: returner (n, d)'s ring, in forwarder n's buffer */
NodeNvlCounters ntail[NN];    /* forwarder n's buffer, written by returner (n, d) */
NodeNvlCounters nhead[NN];    /* forwarder n's buffer, written by forwarder n */

/* In-flight remote writes of pair (n, i), index n * NS + i: a put of positions [from, to) plus its tail
 * signal; a head signal. Enough room for every message of the call. */
chan to_source[NN * NS] = [NUM_TOKENS] of { byte, byte };
chan to_forwarder[NN * NS] = [NUM_TOKENS] of { byte };

byte finished;   /* ranks done with the call */

/* Source i publishes its head of ring (m, i): a remote write into forwarder m's memory. */
inline publish(m) {
  to_forwarder[(m) * NS + i] ! consumed[m];
  published[m] = consumed[m]
}

inline publish_pending() {
  for (m : 0 .. NN - 1) {
    if
    :: consumed[m] > published[m] -> publish(m)
    :: else
    fi
  }
}

active [NS] proctype source() {
  byte i = _pid;
  byte t, n, m, pos;
  byte consumed[NN], published[NN];
  for (t : 0 .. NUM_TOKENS - 1) {
    for (n : 0 .. NN - 1) {
      atomic {
        if
        :: TO_NODE(i, t, n) ->
           pos = consumed[n];
           /* Check the tail once: if it does not cover pos yet, publish the pending heads, then
            * wait. */
           if
           :: rtail[n].c[i] > pos
           :: else ->
#if RDMA_CHUNK > 1 && !defined(NO_PUBLISH_BEFORE_WAIT)
              publish_pending();
#endif
              (rtail[n].c[i] > pos)
           fi;
           assert(ring[n].r[i].slot[pos % RDMA_SLOTS] == TOKEN(i * NUM_TOKENS + t));
           consumed[n] = pos + 1;
           /* With RDMA_CHUNK = 1 every head is published as soon as it is read, so none is ever
            * pending: the statements for pending heads are compiled for RDMA_CHUNK > 1 only (each
            * statement of a verified run is reached). */
#if RDMA_CHUNK > 1
           if
           :: consumed[n] - published[n] >= RDMA_CHUNK -> publish(n)
           :: else
           fi;
#else
           publish(n);
#endif
           pos = 0
        :: else
        fi
      }
    }
  }
#if RDMA_CHUNK > 1
  publish_pending();
#endif
  finished++
}

active [NN] proctype forwarder() {
  byte n = _pid - FORWARDER0;
  byte i, t, d, q, k, sent, total;
  byte pos[ND];
  for (i : 0 .. NS - 1) {
    d_step {
      total = 0;
      for (t : 0 .. NUM_TOKENS - 1) {
        total = total + TO_NODE(i, t, n)
      }
      t = 0
    }
    sent = 0;
    do
    :: sent < total ->
       k = (RDMA_CHUNK < total - sent -> RDMA_CHUNK : total - sent);
       /* Room for the batch in ring (n, i). */
       (rhead[n].c[i] + RDMA_SLOTS >= sent + k);
       for (q : 0 .. k - 1) {
         /* Token t: wait for the row of each of its returners in turn, check it (sum), then free
          * the rows' slots and stage the partial. One atomic step but where it waits. */
#ifndef EARLY_NVL_HEAD
         atomic {
#endif
           do
           :: TO_NODE(i, t, n) -> break
           :: else -> t++
           od;
           for (d : 0 .. ND - 1) {
             if
             :: TO_RET(i, t, n, d) ->
                (ntail[n].c[d] > pos[d]);
#ifdef EARLY_NVL_HEAD
                nhead[n].c[d] = pos[d] + 1;
#endif
                assert(nvl[n].r[d].slot[pos[d] % NVL_SLOTS] == TOKEN(i * NUM_TOKENS + t))
             :: else
             fi
           }
           for (d : 0 .. ND - 1) {
             if
             :: TO_RET(i, t, n, d) ->
                pos[d]++;
                nhead[n].c[d] = pos[d]
             :: else
             fi
           }
           stage[n].r[i].slot[(sent + q) % RDMA_SLOTS] = TOKEN(i * NUM_TOKENS + t);
           t++;
           d = 0
#ifndef EARLY_NVL_HEAD
         }
#endif
       }
       /* Put the staged slots, then signal rtail = sent + k, on one queue pair (delivered in order). */
       atomic {
         to_source[n * NS + i] ! sent, sent + k;
         sent = sent + k;
         k = 0; q = 0
       }
    :: else -> break
    od
  }
  /* Drain: every head signal into this rank's memory has landed. */
  for (i : 0 .. NS - 1) {
    d_step {
      total = 0;
      for (t : 0 .. NUM_TOKENS - 1) {
        total = total + TO_NODE(i, t, n)
      }
      t = 0
    }
    (rhead[n].c[i] >= total)
  }
  finished++
}

active [RETURNERS] proctype returner() {
  byte n = (_pid - RETURNER0 < ND -> 0 : 1 + (_pid - RETURNER0 - ND) / ND_REST);
  byte d = (_pid - RETURNER0 < ND -> _pid - RETURNER0 : (_pid - RETURNER0 - ND) % ND_REST);
  byte i, t, q, k, sent, done, total;
  for (i : 0 .. NS - 1) {
    d_step {
      total = 0;
      for (t : 0 .. NUM_TOKENS - 1) {
        total = total + TO_RET(i, t, n, d)
      }
      t = 0
    }
    done = 0;
    do
    :: done < total ->
       k = (NVL_CHUNK < total - done -> NVL_CHUNK : total - done);
       /* Room for k rows; write them, then publish ntail. */
       atomic {
         (nhead[n].c[d] + NVL_SLOTS >= sent + k) ->
         for (q : 0 .. k - 1) {
           do
           :: TO_RET(i, t, n, d) -> break
           :: else -> t++
           od;
           nvl[n].r[d].slot[(sent + q) % NVL_SLOTS] = TOKEN(i * NUM_TOKENS + t);
           t++
         }
         ntail[n].c[d] = sent + k;
         sent = sent + k;
         done = done + k;
         k = 0; q = 0
       }
    :: else -> break
    od
  }
  finished++
}

/* The NICs of pair (n, i): deliver forwarder n's puts and tail signals to source i, and source i's head
 * signals to forwarder n, each in order, whenever SPIN chooses; they stop once every rank is done and
 * nothing is left in flight. */
active [NN * NS] proctype nic() {
  byte pair = _pid - NIC0;
  byte n = pair / NS;
  byte i = pair % NS;
  byte from, to, p;
  do
  :: d_step {
       to_source[pair] ? from, to;
       for (p : from .. to - 1) {
         ring[n].r[i].slot[p % RDMA_SLOTS] = stage[n].r[i].slot[p % RDMA_SLOTS]
       }
       rtail[n].c[i] = to;
       from = 0; to = 0; p = 0
     }
  :: d_step {
       to_forwarder[pair] ? to;
       rhead[n].c[i] = to;
       to = 0
     }
  :: finished == PARTIES && len(to_source[pair]) == 0 && len(to_forwarder[pair]) == 0 -> break
  od
}
