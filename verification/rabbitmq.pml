/*
 * rabbitmq.pml: the RabbitMQ adapter's ownership protocol for one queue
 * (scope) holding messages of ONE ordering key (crates/rabbitmq).
 *
 *   single active consumer (the broker activates the next consumer only
 *   after the previous one's channel closed, and requeues that channel's
 *   unacknowledged deliveries in queue order when it closes), the fencing
 *   token from the claims stream (a claim published on the consumer's own
 *   channel at its activation, read back before any delivery starts; token
 *   = offset + 1), the channel as the acknowledgement fence (a delivery tag
 *   is only valid on its channel), the ack barrier (a synchronous round trip
 *   behind basic.ack before the key's next message starts), the consumer
 *   task losing the lease when it sees its channel closed, hand-over by
 *   closing the channel, cuts, crashes and reconnects.
 *
 * See verification/README.md ("RabbitMQ") for the step -> code
 * correspondence, the bounds and the invariants; run with scripts/verify.
 *
 * No clocks. A cut closes the channel at the broker at once and the
 * consumer learns of it at any later point (`notice`), so it may start
 * buffered deliveries meanwhile. A stall that the broker ends by closing a
 * silent connection (2 to 3 AMQP heartbeats) is a cut whose consumer has
 * also gone stale (the heartbeat is half the self-fence's freshness), which
 * only removes behaviours: the cut covers it.
 *
 * Configuration (all by -D):
 *   NM, PREFETCH, CUTS, CRASHES, RELEASES, CANCELS   bounds (defaults below;
 *                       NC is 2: the broker's activation choice is written
 *                       out for two consumers)
 *   NO_STORE_FENCE      the handler's store does not refuse older tokens
 *                       (what the adapter guarantees on its own)
 *   CANCEL_BEFORE_CLOSE enable the code path Source::maintain_now takes when
 *                       the claims reader stopped: lose_all aborts the
 *                       consumer tasks (dropping a lapin Consumer sends
 *                       basic.cancel) and only then closes the connection;
 *                       the model lets the cancel reach the broker first
 *   GAPS_OK             check (1) only as "the applied sequence never goes
 *                       back" (a gap, a later message applied while an
 *                       earlier one is still to come, is not flagged at once)
 *   SKIP_1, SKIP_2, SKIP_3  turn one invariant's assertion off
 * Broken variants (each must produce a counter-example, see scripts/verify):
 *   BROKEN_NO_ACK_BARRIER  the key's next message starts once the ack frame
 *                          is written, not confirmed (before commit da8c16c)
 *   BROKEN_CLOCK_TOKEN     the token is the consumer host's clock reading
 *                          (each host's own counter), not a stream offset
 */

#ifndef NC
#define NC 2            /* consumers (instances), each one channel at a time */
#endif
#ifndef NM
#define NM 3            /* messages of the one key, published up front */
#endif
#ifndef PREFETCH
#define PREFETCH 2      /* basic.qos: unacknowledged deliveries per channel */
#endif
#ifndef CUTS
#define CUTS 2          /* connection cuts (the broker closes a live consumer's channel) */
#endif
#ifndef CRASHES
#define CRASHES 1       /* consumer processes killed (they may restart) */
#endif
#ifndef RELEASES
#define RELEASES 1      /* hand-overs: Source::release closes a drained queue's channel */
#endif
#ifndef CANCELS
#define CANCELS 1       /* CANCEL_BEFORE_CLOSE: claims-reader restarts */
#endif

/* broker: message states */
#define READY   0
#define UNACKED 1
#define DONE    2

/* the dispatcher worker's phases (one key: one message at a time) */
#define IDLE    0
#define RUNNING 1       /* the handler is running */
#define ACKING  2       /* basic.ack written, the barrier's answer awaited */

/* claim states of a consumer's current channel */
#define NOCLAIM  0
#define SENT     1      /* the claim frame is on the channel */
#define APPENDED 2      /* appended to the stream; read-back on its way */
#define KNOWN    3      /* the token is known: deliveries may be dispatched */

/* ---------------- broker ---------------- */
byte st[NM + 1];        /* READY, UNACKED, DONE */
byte holder[NM + 1];    /* UNACKED: the consumer whose channel holds it */
byte unacked[NC + 1];   /* UNACKED deliveries on c's channel (derived: no new states) */
byte sac_active;            /* the queue's single active consumer (0: none) */
bit  bopen[NC + 1];     /* c's channel is open at the broker (consumer registered) */
bit  bcancel[NC + 1];   /* c's consumer was cancelled, its channel still open */
byte stream_len;        /* the claims stream: the next offset */

/* ---------------- c's channel: frames on the wire ---------------- */
byte claim_st[NC + 1];
byte claim_off[NC + 1];
byte oq[NC + 1];        /* client -> broker: basic.ack frames in order (2 bits each) */
byte on[NC + 1];        /*   how many */
bit  obar[NC + 1];      /* the barrier's synchronous method, behind the acks */
bit  bar_reply[NC + 1]; /* its answer, on its way back */

/* ---------------- consumer (local) ---------------- */
bit  copen[NC + 1];     /* the consumer believes its channel open (lease not lost) */
bit  crashed[NC + 1];
byte tok[NC + 1];       /* the current lease's token (claim_st == KNOWN) */
byte kq[NC + 1];        /* deliveries received, in order (2 bits each): the */
byte kn[NC + 1];        /*   consumer stream and the dispatcher's key queue */
byte wph[NC + 1];       /* the worker */
byte jm[NC + 1];        /*   its message */
byte jt[NC + 1];        /*   its token */
bit  jcur[NC + 1];      /*   1: its lease is not lost (its channel is current) */
#ifdef BROKEN_CLOCK_TOKEN
byte clk[NC + 1];       /* each host's clock: monotonic on its host only */
#endif

/* ---------------- environment ---------------- */
byte cuts_left = CUTS;
byte crashes_left = CRASHES;
byte releases_left = RELEASES;
byte cancels_left = CANCELS;

/* ---------------- ghosts ---------------- */
byte last_applied;      /* the last message applied (0: none) */
byte store_tok;         /* the highest token the handler's store accepted */
byte act_no;            /* activations so far */
byte ch_act[NC + 1];    /* the activation number of c's current channel */
byte hi_act;            /* the latest activation whose token is known, */
byte hi_tok;            /*   and that token */

#define CHECK(label, cond) if :: (cond) -> skip :: else -> printf(label); assert(cond) fi
#ifdef SKIP_1
#define CHECK_1(label, cond) skip
#else
#define CHECK_1(label, cond) CHECK(label, cond)
#endif
#ifdef SKIP_2
#define CHECK_2(label, cond) skip
#else
#define CHECK_2(label, cond) CHECK(label, cond)
#endif
#ifdef SKIP_3
#define CHECK_3(label, cond) skip
#else
#define CHECK_3(label, cond) CHECK(label, cond)
#endif

#define PUSH(q, n, m) q = q | ((m) << (2 * n)); n++
#define HEAD(q) ((q) & 3)
#define POP(q, n) q = q >> 2; n--

/* The broker closes c's channel: frames not yet processed are lost, the
 * channel's unacknowledged deliveries go back to the queue at their places
 * (the queue delivers the first ready one), and if c was the active
 * consumer the next one may be activated. */
inline broker_close(c) {
  bopen[c] = 0; bcancel[c] = 0;
  oq[c] = 0; on[c] = 0; obar[c] = 0; bar_reply[c] = 0; unacked[c] = 0;
  i = 1;
  do
  :: i <= NM ->
     if :: st[i] == UNACKED && holder[i] == c -> st[i] = READY; holder[i] = 0
        :: else -> skip
     fi;
     i++
  :: else -> break
  od;
  i = 0;
  if :: sac_active == c -> sac_active = 0 :: else -> skip fi
}

/* The consumer task's stream ended (or drop_owned): ScopeLease::lose. The
 * buffered deliveries are discarded by the self-fence; a running handler
 * runs on (a straggler). `closed`: the consumer saw its channel closed, so a
 * settle waiting for the barrier fails (Fenced) and later acks fail at once;
 * otherwise (CANCEL_BEFORE_CLOSE) the channel is still open and works. */
inline lose(c, closed) {
  copen[c] = 0; kq[c] = 0; kn[c] = 0; claim_st[c] = NOCLAIM; tok[c] = 0;
  if
  :: wph[c] == RUNNING -> jcur[c] = 0
  :: wph[c] == ACKING && closed ->
     printf("c%d: barrier failed: m%d's settle is Fenced\n", c, jm[c]);
     wph[c] = IDLE; jm[c] = 0; jt[c] = 0; jcur[c] = 0; bar_reply[c] = 0
  :: wph[c] == ACKING && !closed -> jcur[c] = 0
  :: else -> skip
  fi
}

/* The token of c's activation became known: invariant (2). */
inline token_known(c) {
  printf("c%d: activation %d has token %d\n", c, ch_act[c], tok[c]);
  if
  :: ch_act[c] > hi_act ->
     CHECK_2("VIOLATION (2) a later activation's token is not larger than an earlier one's\n", tok[c] > hi_tok);
     hi_act = ch_act[c]; hi_tok = tok[c]
  :: ch_act[c] < hi_act ->
     CHECK_2("VIOLATION (2) an earlier activation's token is not smaller than a later one's\n", tok[c] < hi_tok)
  :: else -> skip
  fi
}


#if NM == 2
#define ANY_READY (st[1] == READY || st[2] == READY)
#elif NM == 3
#define ANY_READY (st[1] == READY || st[2] == READY || st[3] == READY)
#else
#define ANY_READY (st[1] == READY || st[2] == READY || st[3] == READY || st[4] == READY)
#endif

/* ---------------- the queue: single active consumer, delivery ---------------- */
proctype queue() {
  byte c, i;
end_queue:
  do
  :: atomic { sac_active == 0 && ((bopen[1] && !bcancel[1]) || (bopen[2] && !bcancel[2])) ->
       /* the broker activates the next registered consumer */
       if
       :: bopen[1] && !bcancel[1] -> c = 1
       :: bopen[2] && !bcancel[2] -> c = 2
       fi;
       sac_active = c; act_no++; ch_act[c] = act_no;
       printf("broker: c%d activated (activation %d)\n", c, act_no);
       c = 0 }
  :: atomic { sac_active != 0 && unacked[sac_active] < PREFETCH && ANY_READY ->
       /* the first ready message goes to the active consumer */
       c = sac_active; i = 1;
       do
       :: st[i] != READY -> i++
       :: else -> break
       od;
       st[i] = UNACKED; holder[i] = c; unacked[c]++;
       if
       :: copen[c] -> PUSH(kq[c], kn[c], i);
          printf("broker: m%d delivered to c%d\n", i, c)
       :: else -> printf("broker: m%d delivered to c%d (nobody reads it)\n", i, c)
       fi;
       c = 0; i = 0 }
  od
}

/* The handler's completion is an application if the store takes its token. */
#ifdef NO_STORE_FENCE
#define ACCEPTED(c) true
#else
#define ACCEPTED(c) (jt[c] >= store_tok)
#endif

inline drop_job(c) { wph[c] = IDLE; jm[c] = 0; jt[c] = 0; jcur[c] = 0 }

/* ---------------- one consumer: its channel at the broker, the consumer, and
 * what the environment does to it ---------------- */
proctype consumer(byte c) {
  byte i, d, m;
end_consumer:
  do
  /* ---- the broker, processing c's channel in order ---- */
  :: atomic { bopen[c] && claim_st[c] == SENT ->
       /* the claim reaches the claims stream */
       claim_off[c] = stream_len; stream_len++; claim_st[c] = APPENDED;
       printf("broker: c%d's claim appended at offset %d\n", c, claim_off[c]) }
  :: atomic { bopen[c] && on[c] > 0 ->
       /* basic.ack */
       m = HEAD(oq[c]); POP(oq[c], on[c]);
       if
       :: st[m] == UNACKED && holder[m] == c -> st[m] = DONE; holder[m] = 0; unacked[c]--;
          printf("broker: c%d's ack of m%d processed\n", c, m)
       :: else -> skip
       fi;
       m = 0 }
  :: atomic { bopen[c] && on[c] == 0 && obar[c] ->
       /* the barrier's passive declaration of amq.direct, answered */
       obar[c] = 0; bar_reply[c] = 1 }
  :: atomic { bopen[c] && (crashed[c] || bcancel[c]) ->
       /* a dead process's connection closes / the connection close after the cancel */
       printf("broker: c%d's channel closed\n", c);
       broker_close(c) }

  /* ---- the environment ---- */
  :: atomic { bopen[c] && !crashed[c] && !bcancel[c] && cuts_left > 0 ->
       printf("CUT: c%d's connection closed at the broker\n", c);
       cuts_left--; broker_close(c) }
  :: atomic { !crashed[c] && crashes_left > 0 && (copen[c] || wph[c] != IDLE) ->
       printf("CRASH: c%d (its handler dies with it)\n", c);
       crashes_left--; crashed[c] = 1;
       lose(c, 1); drop_job(c) }
#ifdef CANCEL_BEFORE_CLOSE
  :: atomic { copen[c] && bopen[c] && !bcancel[c] && cancels_left > 0 ->
       /* maintain_now, "claims reader stopped": lose_all aborts the consumer
        * tasks (lapin sends basic.cancel for a dropped active consumer), then
        * the connection is closed: the cancel is processed first */
       printf("c%d: claims reader stopped: lose_all, basic.cancel reaches the broker before the close\n", c);
       cancels_left--;
       lose(c, 0);
       bcancel[c] = 1;
       if :: sac_active == c -> sac_active = 0 :: else -> skip fi }
#endif

  /* ---- the consumer ---- */
  :: atomic { copen[c] && !bopen[c] ->
       /* the consumer task sees its stream end (or maintain's round trip
        * fails): the lease is lost */
       printf("c%d: notices its channel closed: lease %d lost, %d buffered discarded\n", c, tok[c], kn[c]);
       lose(c, 1) }
  :: atomic { !copen[c] && !bopen[c] && wph[c] != ACKING ->
       /* (re)connect, or restart after a crash: a new channel, consume */
       crashed[c] = 0; copen[c] = 1; bopen[c] = 1;
       printf("c%d: consumes on a new channel\n", c) }
  :: atomic { copen[c] && bopen[c] && !crashed[c] && releases_left > 0 && sac_active == c &&
              wph[c] == IDLE && on[c] == 0 && !obar[c] && claim_st[c] != SENT ->
       /* Source::release: drained, the channel closed (requeues what it
        * holds, then the next consumer is activated), then drop_owned */
       printf("c%d: release: channel closed (hand-over)\n", c);
       releases_left--; broker_close(c); lose(c, 1) }
  :: atomic { copen[c] && kn[c] > 0 && claim_st[c] == NOCLAIM ->
       /* activation: the first delivery; the claim on the queue's own channel */
#ifdef BROKEN_CLOCK_TOKEN
       clk[c]++; tok[c] = clk[c]; claim_st[c] = KNOWN;
       token_known(c)
#else
       claim_st[c] = SENT;
       printf("c%d: first delivery: claim published on its channel\n", c)
#endif
     }
  :: atomic { copen[c] && claim_st[c] == APPENDED ->
       /* the claim read back through the claims reader: token = offset + 1 */
       tok[c] = claim_off[c] + 1; claim_st[c] = KNOWN;
       token_known(c) }
  :: atomic { copen[c] && claim_st[c] == KNOWN && kn[c] > 0 && wph[c] == IDLE ->
       /* the dispatcher takes the key's next delivery; the self-fence (the
        * lease is not lost); the handler starts */
       jm[c] = HEAD(kq[c]); POP(kq[c], kn[c]);
       jt[c] = tok[c]; jcur[c] = 1; wph[c] = RUNNING;
       printf("c%d: m%d starts under token %d\n", c, jm[c], jt[c]);
       d = 1;
       do
       :: d <= NC ->
          CHECK_3("VIOLATION (3) two handlers of the key run at once and the other is not an older, fenced straggler\n",
                  d == c || wph[d] != RUNNING ||
                  (jt[d] < jt[c] && (!jcur[d] || !bopen[d])) ||  /* the other is the straggler */
                  (jt[c] < jt[d] && !bopen[c]));                 /* this start is the straggler */
          d++
       :: else -> break
       od;
       d = 0 }
  :: atomic { wph[c] == RUNNING && (ACCEPTED(c) || !jcur[c]) ->
       /* the handler returns */
       if
       :: ACCEPTED(c) ->
          printf("c%d: m%d APPLIED under token %d\n", c, jm[c], jt[c]);
#ifdef GAPS_OK
          CHECK_1("VIOLATION (1) applied out of order: an older message after a newer one\n",
                  jm[c] >= last_applied);
#else
          CHECK_1("VIOLATION (1) applied out of order: an older message after a newer one, or a gap\n",
                  jm[c] == last_applied + 1 || jm[c] == last_applied);
#endif
          last_applied = jm[c];
          if :: jt[c] > store_tok -> store_tok = jt[c] :: else -> skip fi;
          if
          :: jcur[c] || bcancel[c] ->
             /* basic.ack written on the delivery's channel (lost if the
              * broker closed it meanwhile) */
             if :: bopen[c] -> PUSH(oq[c], on[c], jm[c]) :: else -> skip fi;
#ifdef BROKEN_NO_ACK_BARRIER
             printf("c%d: m%d's ack written; the key moves on\n", c, jm[c]);
             drop_job(c)
#else
             if :: bopen[c] -> obar[c] = 1 :: else -> skip fi;
             wph[c] = ACKING
#endif
          :: else ->
             printf("c%d: m%d's ack fails: the channel is closed (Fenced)\n", c, jm[c]);
             drop_job(c)
          fi
       :: else ->
          printf("c%d: m%d refused by the store (token %d < %d): discarded\n", c, jm[c], jt[c], store_tok);
          drop_job(c)
       fi }
  :: atomic { wph[c] == ACKING && bar_reply[c] ->
       /* the barrier answered: the broker has the ack; the key moves on */
       printf("c%d: m%d's ack confirmed\n", c, jm[c]);
       bar_reply[c] = 0; drop_job(c) }
  :: atomic { wph[c] == ACKING && !jcur[c] && !bcancel[c] ->
       /* CANCEL_BEFORE_CLOSE: the cancelled channel closed under the barrier */
       bar_reply[c] = 0; drop_job(c) }
  od
}

init {
  atomic {
    run queue();
    run consumer(1);
    run consumer(2)
  }
}
