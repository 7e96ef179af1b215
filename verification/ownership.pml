/*
 * ownership.pml: the keyorder ownership protocol of one scope (a PostgreSQL
 * slot, a Redis partition stream) holding messages of ONE ordering key.
 *
 *   lease {owner}:{generation} with an expiry on the broker's clock,
 *   heartbeat renew, a generation counter that never goes back, fenced read,
 *   fenced begin_attempt, fenced ack, reclaim of earlier generations' pending
 *   entries, and the consumer's self-fence (ScopeLease).
 *
 * See verification/README.md for the step -> code correspondence, the bounds
 * and the invariants; run everything with scripts/verify.
 *
 * Time is relative, so the state space stays finite without a bound on the
 * number of ticks: the broker keeps `lease_left` (ticks until the lease
 * expires, 0 = expired or released: the Redis key is gone, the PostgreSQL
 * lease_expiry is in the past), each consumer keeps `age` (ticks since its last
 * broker-confirmed ownership, counted from when the confirming round trip was
 * SENT, saturating at FRESH). One `tick` advances both. A tick may come
 * between ANY two steps of any consumer: that is a pause. A pause becomes a
 * stall past the lease when it lets the lease of a live holder expire, which
 * the environment may do at most STALLS times; a crashed holder's lease
 * expires freely. Crashes (a consumer stops forever) are at most CRASHES, and
 * at least one consumer never crashes.
 *
 * Configuration (all by -D):
 *   NC, NM, TTL, MARGIN, STALLS, CRASHES, RELEASES  bounds (defaults below;
 *                     NC is 2 or 3)
 *   DRIFT             ticks a consumer's clock may miss per lease period (0)
 *   LIVENESS          add the GST process and the LTL property (d)
 *   STRICT_ONCE       also check the stronger form of (a): each message is
 *                     applied exactly once, and a start is always of the
 *                     first unapplied message
 *   NO_ATTEMPT_FENCE  begin_attempt is not fenced at the broker (a transport
 *                     whose handler start has no fenced broker step); the
 *                     self-fence check is then made at the start's instant
 *   NO_SELF_FENCE     ScopeLease::state() never says Stale (the age test is
 *                     gone); begin_attempt's fence alone guards starts
 *   NO_SAFETY         turn the safety assertions off (liveness-only runs)
 *   SKIP_A, SKIP_B, SKIP_C, SKIP_E  turn one invariant's assertion off, to
 *                     see what a broken variant leads to beyond the first
 *                     invariant it breaks
 * Broken variants (each must produce a counter-example, see scripts/verify):
 *   BROKEN_NO_ACK_FENCE     the ack is a plain XACK / unfenced update
 *   BROKEN_NO_SELF_FENCE    no self-fence AND no fenced begin_attempt
 *   BROKEN_NO_RECLAIM       a new owner reads only new entries (no XAUTOCLAIM,
 *                           or PostgreSQL reading from its own position
 *                           instead of the slot's cursor)
 *   BROKEN_PARTIAL_RECLAIM  XAUTOCLAIM called once (one page), not until 0-0
 *   BROKEN_NO_READ_FENCE    XREADGROUP / the read select without the lease check
 *   BROKEN_GEN_RESET        the generation restarts at 1 on a fresh acquire
 *                           (the counter expired with the lease)
 *   BROKEN_SELF_FENCE_GAP   self-fence only (NO_ATTEMPT_FENCE) but the check
 *                           and the start are separate steps: a stall between
 *                           them is not covered
 *   BROKEN_NO_MARGIN        self-fence only, margin 0, and the consumer's
 *                           clock may run one tick slow per lease period
 *   BROKEN_CONFIRM_ON_READ  self-fence only, and a successful fenced read
 *                           counts as a confirmation although it does not
 *                           extend the lease (ScopeLease::confirm after READ)
 */

#ifndef NC
#define NC 2            /* consumers (processes of the subscription), 2 or 3 */
#endif
#ifndef NM
#define NM 3            /* messages of the one key, published up front */
#endif
#ifndef TTL
#define TTL 3           /* lease TTL, in ticks of the broker's clock */
#endif
#ifndef MARGIN
#define MARGIN 1        /* self-fence safety margin, in ticks */
#endif
#ifndef STALLS
#define STALLS 2        /* live holders' leases that may expire (stalls past the lease) */
#endif
#ifndef CRASHES
#define CRASHES (NC - 1) /* consumers that may stop forever: one always survives */
#endif
#ifndef RELEASES
#define RELEASES 1      /* voluntary hand-overs (revoke, drained, release) */
#endif

#ifdef BROKEN_NO_SELF_FENCE
#define NO_SELF_FENCE
#define NO_ATTEMPT_FENCE
#endif
#ifdef BROKEN_SELF_FENCE_GAP
#define NO_ATTEMPT_FENCE
#endif
#ifdef BROKEN_CONFIRM_ON_READ
#define NO_ATTEMPT_FENCE
#endif
#ifdef BROKEN_NO_MARGIN
#define NO_ATTEMPT_FENCE
#undef MARGIN
#define MARGIN 0
#define DRIFT 1         /* the local clock may miss this many ticks per lease period */
#endif
#ifndef DRIFT
#define DRIFT 0
#endif

#define FRESH (TTL - MARGIN)  /* LeaseConfig::fresh_for(): fresh iff age < FRESH */
#define ALL   ((1 << (NM + 1)) - 2) /* bits 1..NM */

/* worker phases (one dispatcher worker per consumer: one key, one at a time) */
#define IDLE    0
#define PICKED  1       /* a buffered delivery taken from the key's queue */
#define CHECKED 2       /* the self-fence said Fresh; begin_attempt not yet sent */
#define RUNNING 3       /* begin_attempt succeeded: the handler is in progress */

/* ---------------- broker state ---------------- */
byte lease_owner;       /* slots.owner / the owner part of {stream}:__lease__ */
byte lease_gen;         /* slots.generation / the generation part of the lease */
byte lease_left;        /* ticks until lease_expiry; 0: expired or released */
byte gen_counter;       /* the generation counter (never expires) */
byte next_new = 1;      /* first entry never delivered to the group ('>') */
byte pend_own[NM + 1];  /* PEL: holder (owner, generation) an entry is pending for; */
byte pend_gen[NM + 1];  /*      owner 0: not pending (never delivered, or acked)    */

/* ---------------- consumer state (local, survives a stall) ---------------- */
byte gen[NC + 1];       /* generation of the lease it believes it holds; 0: none */
byte age[NC + 1];       /* ticks since the last confirmation (saturates at FRESH) */
byte drift[NC + 1];     /* ticks the local clock missed since the last confirmation */
byte buf[NC + 1];       /* buffered deliveries (bit m): the dispatcher's key queue */
bit  need_reclaim[NC + 1];
byte wphase[NC + 1];    /* the worker's phase */
byte jm[NC + 1];        /* the worker's job: message, */
byte jg[NC + 1];        /*   generation it was delivered under (fencing token), */
bit  jlost[NC + 1];     /*   and whether its ScopeLease was marked lost */
bit  crashed[NC + 1];

/* ---------------- environment ---------------- */
byte stalls_left = STALLS;
byte crashes_left = CRASHES;
byte releases_left = RELEASES;
bit  gst;               /* liveness runs: from here on no failures, timely heartbeats */

/* ---------------- ghosts (observation only) ---------------- */
byte last_applied;      /* the last message applied (0: none) */
byte applied_set;       /* bit m: m was applied at least once */
byte max_gen;           /* the highest generation ever issued */

#define HOLDS(c, g) (lease_left > 0 && lease_owner == (c) && lease_gen == (g))
/* PgSource::acquire's where clause: free, expired, or already ours. (The
 * Redis ACQUIRE script needs the key to be gone; `owner = me` with a live
 * lease is unreachable here: a consumer drops a lease only when the broker
 * says it is not held at its generation.) */
#define ACQUIRABLE(c) (lease_left == 0 || lease_owner == (c))
#ifdef NO_SELF_FENCE
#define IS_FRESH(c) true
#else
#define IS_FRESH(c) (age[c] < FRESH)
#endif

#ifdef NO_SAFETY
#define CHECK(label, cond) skip
#else
#define CHECK(label, cond) if :: (cond) -> skip :: else -> printf(label); assert(cond) fi
#endif
#ifdef SKIP_A
#define CHECK_A(label, cond) skip
#else
#define CHECK_A(label, cond) CHECK(label, cond)
#endif
#ifdef SKIP_B
#define CHECK_B(label, cond) skip
#else
#define CHECK_B(label, cond) CHECK(label, cond)
#endif
#ifdef SKIP_C
#define CHECK_C(label, cond) skip
#else
#define CHECK_C(label, cond) CHECK(label, cond)
#endif
#ifdef SKIP_E
#define CHECK_E(label, cond) skip
#else
#define CHECK_E(label, cond) CHECK(label, cond)
#endif

/* ScopeLease::lose(), PgSource dropping the slot, Dispatcher::discard_lost:
 * the buffered deliveries go; a running handler runs on (the straggler). */
inline lose(c) {
  printf("c%d: lose: lease %d dropped, %d buffered deliveries discarded\n", c, gen[c], buf[c]);
  gen[c] = 0; age[c] = 0; drift[c] = 0; buf[c] = 0; need_reclaim[c] = 0;
  if
  :: wphase[c] != IDLE -> jlost[c] = 1
  :: else -> skip
  fi
}

/* ---------------- the consumer's source loop: maintain, then fetch -------- */

/* acquire: PgSource::acquire (sql.acquire) / the Redis ACQUIRE script */
inline acquire(c) {
#ifdef BROKEN_GEN_RESET
  if
  :: lease_left > 0 -> gen_counter = lease_gen + 1
  :: else -> gen_counter = 1          /* the counter expired with the lease */
  fi;
#else
  gen_counter++;
#endif
  printf("c%d: acquire: lease c%d:%d\n", c, c, gen_counter);
  CHECK_E("VIOLATION (e) generations never go backwards: a fresh acquire reused or lowered a generation\n",
        gen_counter > max_gen);
  if :: gen_counter > max_gen -> max_gen = gen_counter :: else -> skip fi;
  lease_owner = c; lease_gen = gen_counter; lease_left = TTL;
  gen[c] = gen_counter; age[c] = 0; drift[c] = 0;
#ifndef BROKEN_NO_RECLAIM
  need_reclaim[c] = 1
#endif
}

/* reclaim: XAUTOCLAIM <stream> <group> <holder> 0 <cursor> until the cursor
 * is 0-0 (inside the ACQUIRE script), then the holder re-reads its own
 * pending entries from id 0 / PostgreSQL: the new owner's read position
 * starts at the slot's cursor, so every unacknowledged event of earlier
 * generations is read again, in order. A fresh holder has no pending entries
 * of its own, so "every pending entry" is "every entry of earlier
 * generations". */
inline reclaim(c) {
  m = 1;
  do
  :: m <= NM ->
     if
     :: pend_own[m] != 0 ->   /* every pending entry, whoever holds it */
        printf("c%d: reclaim: m%d (pending for c%d:%d) -> c%d:%d\n", c, m, pend_own[m], pend_gen[m], c, gen[c]);
        pend_own[m] = c; pend_gen[m] = gen[c]; buf[c] = buf[c] | (1 << m);
#ifdef BROKEN_PARTIAL_RECLAIM
        m = NM;                       /* one page, the cursor not followed */
#endif
     :: else -> skip
     fi;
     m++
  :: else -> break
  od;
  m = 0;
  need_reclaim[c] = 0
}

/* fenced_read: sql.read (join on owner, generation, lease_expiry) / the Redis
 * READ script (GET lease == holder, then XREADGROUP '>'), one entry a time. */
inline fenced_read(c) {
  printf("c%d: read: m%d delivered to c%d:%d\n", c, next_new, c, gen[c]);
  pend_own[next_new] = c; pend_gen[next_new] = gen[c];
  buf[c] = buf[c] | (1 << next_new);
  next_new++;
#ifdef BROKEN_CONFIRM_ON_READ
  age[c] = 0; drift[c] = 0;           /* confirm(sent), but the expiry stays */
  printf("c%d: read counted as a confirmation (the lease was not extended)\n", c);
#endif
  skip
}

proctype source(byte c) {
  byte m;
end_source:
  do
  :: /* maintain: PgSource::maintain_now / the Redis RENEW and ACQUIRE scripts */
     if
     :: atomic { !crashed[c] && gen[c] != 0 ->          /* renew (heartbeat) */
          if
          :: HOLDS(c, gen[c]) -> lease_left = TTL; age[c] = 0; drift[c] = 0; /* confirm(sent) */
             printf("c%d: renew: c%d:%d confirmed\n", c, c, gen[c])
          :: else -> lose(c)                            /* "slot lease lost" */
          fi }
     :: atomic { !crashed[c] && gen[c] == 0 && ACQUIRABLE(c) -> acquire(c) }
     :: atomic { !crashed[c] && !gst && releases_left > 0 && gen[c] != 0 && HOLDS(c, gen[c]) &&
                 buf[c] == 0 && wphase[c] == IDLE ->
          /* release: a revoked scope, drained (held_in_scope == 0): sql.release
           * / the RELEASE script, then ScopeLease::lose */
          printf("c%d: release: c%d:%d\n", c, c, gen[c]);
          lease_left = 0; releases_left--; lose(c) }
     fi;
     /* fetch: PgSource::read / the Redis READ script */
     atomic { !crashed[c] ->
       if
       :: gen[c] != 0 && need_reclaim[c] ->
          if
          :: HOLDS(c, gen[c]) -> reclaim(c)
          :: else -> lose(c)
          fi
       :: gen[c] != 0 && !need_reclaim[c] && next_new <= NM ->
#ifdef BROKEN_NO_READ_FENCE
          fenced_read(c)
#else
          if
          :: HOLDS(c, gen[c]) -> fenced_read(c)
          :: else -> lose(c)                            /* fenced: nothing read */
          fi
#endif
       :: else -> skip
       fi }
  od
}

/* ---------------- the dispatcher worker: Inner::process ------------------- */

/* The handler starts: begin_attempt returned a count. The invariants that a
 * start must keep are checked here. */
inline start(c) {
  printf("c%d: begin_attempt ok: m%d starts under c%d:%d\n", c, jm[c], c, jg[c]);
  CHECK_C("VIOLATION (c) a consumer started a message while not holding the lease at its generation\n",
        HOLDS(c, jg[c]));
  d = 1;
  do
  :: d <= NC ->
     CHECK_B("VIOLATION (b) two owners' handlers overlap and the other is not an older, fenced straggler\n",
           d == c || wphase[d] != RUNNING || (jg[d] < jg[c] && !HOLDS(d, jg[d])));
     d++
  :: else -> break
  od;
  d = 0;
  CHECK_A("VIOLATION (a) a start skipped an unapplied message or went back past the in-flight one\n",
        jm[c] == last_applied + 1 || jm[c] == last_applied);
#ifdef STRICT_ONCE
  CHECK_A("VIOLATION (a, strict) a start of a message that is not the first unapplied one\n",
        jm[c] == last_applied + 1);
#endif
  wphase[c] = RUNNING
}

/* The handler returned Ok and the broker accepted the ack: applied. */
inline apply(c) {
  printf("c%d: ack accepted: m%d APPLIED (token %d)\n", c, jm[c], jg[c]);
  pend_own[jm[c]] = 0; pend_gen[jm[c]] = 0;   /* XACK / insert into acked */
  CHECK_A("VIOLATION (a) applied out of order: an older message after a newer one, or a gap\n",
        jm[c] == last_applied + 1 || jm[c] == last_applied);
#ifdef STRICT_ONCE
  CHECK_A("VIOLATION (a, strict) a message applied twice\n", jm[c] == last_applied + 1);
#endif
  last_applied = jm[c];
  applied_set = applied_set | (1 << jm[c])
}

inline drop_job(c) {
  wphase[c] = IDLE; jm[c] = 0; jg[c] = 0; jlost[c] = 0
}

proctype worker(byte c) {
  byte m, d;
end_worker:
  do
  :: atomic { !crashed[c] && wphase[c] == IDLE && buf[c] != 0 ->
       /* the key's queue is FIFO by arrival = by entry id */
       m = 1;
       do
       :: (buf[c] & (1 << m)) == 0 -> m++
       :: else -> break
       od;
       buf[c] = buf[c] & ~(1 << m);
       jm[c] = m; jg[c] = gen[c]; jlost[c] = 0; wphase[c] = PICKED;
       printf("c%d: dispatch: m%d taken from the key's queue (lease %d)\n", c, m, gen[c]);
       m = 0 }
  :: atomic { !crashed[c] && wphase[c] == PICKED && (jlost[c] || IS_FRESH(c)) ->
       /* self_fence: ScopeLease::usable (waits while Stale) */
       if
       :: jlost[c] ->                                   /* Outcome::Lost: discarded */
          printf("c%d: self_fence: m%d discarded (lease %d lost)\n", c, jm[c], jg[c]);
          drop_job(c)
       :: else ->
#if defined(NO_ATTEMPT_FENCE) && !defined(BROKEN_SELF_FENCE_GAP)
          start(c)            /* the check is made at the start's instant */
#else
          printf("c%d: self_fence: lease %d fresh (age %d)\n", c, jg[c], age[c]);
          wphase[c] = CHECKED
#endif
       fi }
  :: atomic { !crashed[c] && wphase[c] == CHECKED ->
       /* begin_attempt: sql.attempt_batch / the Redis ATTEMPT script */
#ifdef NO_ATTEMPT_FENCE
       start(c)
#else
       if
       :: HOLDS(c, jg[c]) -> start(c)
       :: else ->                                       /* Error::Fenced */
          printf("c%d: begin_attempt fenced: m%d (token %d) not started\n", c, jm[c], jg[c]);
          if :: !jlost[c] -> lose(c) :: else -> skip fi;
          drop_job(c)
       fi
#endif
     }
  :: atomic { !crashed[c] && wphase[c] == RUNNING ->
       /* the handler returns Ok; fenced_ack: sql.ack_batch / the Redis ACK script */
#ifdef BROKEN_NO_ACK_FENCE
       apply(c);
#else
       if
       :: HOLDS(c, jg[c]) -> apply(c)
       :: else ->                                       /* rejected: Error::Fenced */
          printf("c%d: ack fenced: m%d (token %d) rejected\n", c, jm[c], jg[c]);
          if :: !jlost[c] -> lose(c) :: else -> skip fi
       fi;
#endif
       drop_job(c) }
  od
}

/* ---------------- environment: the clocks, stalls, crashes ---------------- */

inline crash(c) {
  printf("c%d: CRASH (stops forever)\n", c);
  crashed[c] = 1; crashes_left--;
  wphase[c] = IDLE; jm[c] = 0; jg[c] = 0; jlost[c] = 0;  /* its handler dies with it */
  buf[c] = 0; need_reclaim[c] = 0
}

proctype env() {
  byte c;
end_env:
  do
  :: atomic { !gst ->                                   /* tick */
       if
       :: lease_left > 1 -> lease_left--
       :: lease_left == 1 && crashed[lease_owner] -> lease_left = 0;
          printf("tick: c%d:%d expired (holder crashed)\n", lease_owner, lease_gen)
       :: lease_left == 1 && !crashed[lease_owner] && stalls_left > 0 ->
          lease_left = 0; stalls_left--;                /* the holder stalled past its lease */
          printf("tick: c%d stalled past its lease: c%d:%d expired\n", lease_owner, lease_owner, lease_gen)
       :: lease_left == 1 && !crashed[lease_owner] -> skip  /* its heartbeat is on time */
       :: lease_left == 0 -> skip
       fi;
       c = 1;
       do
       :: c <= NC ->
          if
          :: gen[c] != 0 && age[c] < FRESH ->
             if
             :: age[c]++
#if DRIFT > 0
             :: drift[c] < DRIFT -> drift[c]++;         /* the local clock ran slow */
                printf("tick: c%d's clock missed this tick\n", c)
#endif
             fi
          :: else -> skip
          fi;
          c++
       :: else -> break
       od;
#if NC >= 3
       printf("tick: lease %d left; ages c1=%d c2=%d c3=%d\n", lease_left, age[1], age[2], age[3]);
#else
       printf("tick: lease %d left; ages c1=%d c2=%d\n", lease_left, age[1], age[2]);
#endif
       c = 0 }
  :: atomic { gst && lease_left > 0 && crashed[lease_owner] -> lease_left-- }
  :: atomic { !gst && crashes_left > 0 && !crashed[1] -> crash(1) }
  :: atomic { !gst && crashes_left > 0 && !crashed[2] -> crash(2) }
#if NC >= 3
  :: atomic { !gst && crashes_left > 0 && !crashed[3] -> crash(3) }
#endif
  od
}

#ifdef LIVENESS
/* From GST on: no stall, crash or release any more, and a live holder's
 * heartbeat keeps both its lease and its self-fence fresh. Weak fairness
 * makes this one step happen eventually. */
proctype global_stabilisation() {
  gst = 1
}

/* (d) nothing acknowledged by the broker is lost: every message is applied. */
ltl d_every_message_applied { <> (applied_set == ALL) }
#endif

init {
  atomic {
    run env();
    run source(1); run worker(1);
    run source(2); run worker(2);
#if NC >= 3
    run source(3); run worker(3);
#endif
#ifdef LIVENESS
    run global_stabilisation();
#endif
  }
}
