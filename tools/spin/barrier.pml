/* Intra-node barrier over the ranks' buffers.
 *
 * Each rank r owns arrive[R] monotonic counters in its buffer; arrive[i] in r's buffer is the last
 * barrier rank i entered. Every rank calls the same sequence of barriers e = 1 .. E. In barrier e,
 * rank me stores e (release) into arrive[me] of every rank's buffer, itself included, then waits until
 * every arrive[i] of its own buffer is >= e. The counters are never reset, so a rank already in
 * barrier e+1 (storing e+1) still lets a slower one leave e.
 *
 * Checked: no rank leaves barrier e before all R ranks have entered it (ghost counter entered[e]), and
 * no invalid end state. -DOFF_BY_ONE plants the bug of waiting for arrive[i] >= e - 1.
 *
 * Sizes are set with spin -DR=.. -DE=..
 */
#ifndef R
#define R 3
#endif
#ifndef E
#define E 3
#endif
#ifdef OFF_BY_ONE
#define ENOUGH(e) ((e) - 1)
#else
#define ENOUGH(e) (e)
#endif

typedef Buffer { byte arrive[R] };
Buffer buf[R];
byte entered[E + 1];   /* ghost: ranks that have entered barrier e */

active [R] proctype rank() {
  byte e, i;
  for (e : 1 .. E) {
    entered[e]++;
    for (i : 0 .. R - 1) {
      buf[i].arrive[_pid] = e
    }
    for (i : 0 .. R - 1) {
      (buf[_pid].arrive[i] >= ENOUGH(e))
    }
    assert(entered[e] == R)
  }
}
