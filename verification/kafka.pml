/*
 * kafka.pml: the Kafka adapter's ownership protocol of one partition, as
 * crates/kafka/src/state.rs and source.rs run it.
 *
 *   The state partition is an append-only, compacted log of
 *     MARK   a claim's marker: a new owner appends it, then reads from the
 *            group's pointer up to it (state::load);
 *     CHECK  a pointer check's marker (state::advance);
 *     REC    a state record: (generation, committed offset), keyed by the
 *            group and generation (state::record_key; BROKEN_GROUP_KEY: by
 *            the group alone, as wave 1 wrote them).
 *   Every marker has one key (state::MARKER_KEY). Keys in the narration:
 *   255 the markers', g the records of generation g (BROKEN_GROUP_KEY: 0,
 *   the group's).
 *   The pointer is the group's committed offset on the state partition.
 *
 *   An owner claims (reads the pointer, appends its marker, reads up to it:
 *   the newest record of the highest generation is its state; its
 *   generation is one above the larger of the marker's offset and every
 *   generation read), then runs rounds: apply the next message (only while
 *   it is the owner: the self-fence stops new work once the partition was
 *   given away), write a record, and move the pointer to it after a check
 *   (state::advance: read the pointer, append a check marker, read up to
 *   it; a record of a higher generation means the partition was lost: the
 *   pointer is left alone and the owner stops). With SPARSE_CHECKPOINTS a
 *   round may skip the check (source.rs moves the pointer every
 *   CHECKPOINT_EVERY, not after every record): a later one then moves the
 *   pointer to the newest record.
 *
 *   The coordinator hands the partition to the next owner at any point
 *   after the current one claimed: the old owner may be stalled anywhere in
 *   a round, and its record write, its check and its pointer commit then
 *   land late, interleaved with the next owners' steps.
 *
 *   Compaction (the log cleaner) drops entries that have a newer entry of
 *   the same key, from the start of the log: what a reader misses is, for
 *   each key, a run of its oldest entries, never its newest. The state
 *   topic must have min.compaction.lag.ms (see verification/README.md; an
 *   hour, lib.rs STATE_MIN_COMPACTION_LAG_MS): an entry younger than the
 *   lag is never cleaned and never supersedes an older one, and a read
 *   takes less than the lag (read_range gives up after READ_BUDGET, 10
 *   minutes), so an entry appended after a read's end marker never hides
 *   an entry from that read. Then a read's marker and the read itself can
 *   be one step: every drop that hits a running read is superseded inside
 *   the read's range, so it could as well have come just before the
 *   marker. NO_COMPACTION_LAG drops the lag: the marker and the read are
 *   two steps, and the drops before the read may be superseded by anything
 *   appended meanwhile.
 *   Only a read sees a drop, so compaction is modelled in the reads: each
 *   read meets up to COMPACTIONS drops (one drop: every entry of one key up
 *   to a superseded one), and forgets them afterwards. Each read so sees
 *   the log as some compaction could have left it, whatever earlier reads
 *   saw: more than the cleaner can do (it never brings an entry back),
 *   which is sound for the correct model; in each broken variant's trail
 *   at most one read meets compaction, so it is a real run. Markers are
 *   compacted only under BROKEN_COUNTED_GEN: no other read looks at them.
 *
 *   Steps that touch only an owner's own variables are merged into the
 *   step before or after them (the others cannot see them).
 *
 * Assumption (not modelled): a claim is made while its assignment is
 * current (the hand-over waits for the claim). A member stalled inside its
 * assignment callback is the self-fence's case (lease age), as in
 * ownership.pml.
 *
 * Invariants (each assertion prints its label before failing):
 *   (k1) per-key order: an owner never applies a message below the last one
 *        applied (the one redelivery of the last is at-least-once);
 *   (k2) fencing tokens: every claim's generation is above every earlier
 *        claim's.
 *
 * Configuration (-D): NO owners (claims, in turn order; default 3), R
 * rounds per owner (3), COMPACTIONS drops a read meets (NO + 1: every key
 * a read can meet), SPARSE_CHECKPOINTS.
 * Broken variants (issue 35):
 *   BROKEN_POINTER     the pointer is committed to the newest record without
 *                      the check (wave 1's commit_pointers): a stale owner's
 *                      late commit hides the newer owner's records from the
 *                      next claim (finding 1): (k1)
 *   BROKEN_GROUP_KEY   records keyed by the group alone (wave 1): a stale
 *                      owner's late record is the newest of the key, so
 *                      compaction drops the newer owner's records, which the
 *                      loader would have ranked first (finding 2): (k1)
 *   BROKEN_COUNTED_GEN the generation is counted from the records and
 *                      markers read (wave 1), not taken above the marker's
 *                      offset: every marker has one key, compaction drops
 *                      an earlier claim's marker, and a generation repeats
 *                      (finding 2): (k2)
 *   NO_COMPACTION_LAG  the state topic without min.compaction.lag.ms (as
 *                      lib.rs created it before commit e430e62, and as a
 *                      state topic created before then still is): (k1)
 */

#ifndef NO
#define NO 3
#endif
#ifndef R
#define R 3
#endif
#ifndef COMPACTIONS
#define COMPACTIONS (NO + 1)
#endif
#define L (NO * (1 + 2 * R))    /* log capacity: a marker per claim, a record and a check per round */

#define MARK   1
#define CHECKM 2
#define REC    3

byte kind[L];           /* 0: never written */
byte lgen[L];           /* REC: generation */
byte lval[L];           /* REC: committed offset (the last message applied) */
byte lkey[L];           /* compaction key */
bit  gone[L];           /* dropped by compaction */
bit  sup[L];            /* a newer entry of the same key exists (compaction may drop it) */
byte top;
byte pointer;           /* the group's committed offset on the state partition */

byte turn;              /* the owner the coordinator assigned */
bit  claimed[NO];
byte last_applied;      /* ghost: the last message applied */
byte max_gen;           /* ghost: the highest generation claimed */

#define MARKER_KEY 255
#ifdef BROKEN_GROUP_KEY
#define REC_KEY(g) 0
#else
#define REC_KEY(g) (g)
#endif
#ifdef BROKEN_COUNTED_GEN
#define COMPACTED(i) (kind[i] != 0)
#else
#define COMPACTED(i) (kind[i] == REC)
#endif

#define CHECK(label, cond) if :: (cond) -> skip :: else -> printf(label); assert(cond) fi

inline append(k, g, v, key, at) {
  i = 0;
  do
  :: i < top -> if :: lkey[i] == key -> sup[i] = 1 :: else -> skip fi; i++
  :: else -> break
  od;
  i = 0;
  kind[top] = k; lgen[top] = g; lval[top] = v; lkey[top] = key; at = top; top++
}

/* The compaction a read meets (see the header), before it reads from
 * `from`: up to COMPACTIONS drops, each of every entry of one key up to a
 * superseded one. */
inline compaction(from) {
  k = COMPACTIONS;
  do
  :: k > 0 ->
     i = from; j = 255;
     do
     :: i < top && sup[i] && !gone[i] && COMPACTED(i) -> j = i; break
     :: i < top -> i++
     :: i >= top -> break
     od;
     if
     :: j == 255 -> break
     :: else ->
        d_step {
          i = 0;
          do
          :: i <= j -> if :: lkey[i] == lkey[j] -> gone[i] = 1 :: else -> skip fi; i++
          :: else -> break
          od;
          k--;
          printf("compaction: drops the entries of key %d up to %d\n", lkey[j], j)
        }
     fi
  :: break
  od;
  i = 0; j = 0; k = 0
}

/* After a read: its compaction forgotten. */
inline forget() {
  i = 0;
  do
  :: i < top -> gone[i] = 0; i++
  :: else -> break
  od;
  i = 0
}

/* Reads entries from..end (inclusive), skipping compacted ones: the newest
 * record of the highest generation (best_g 0: none). */
inline scan(from, end, best_g, best_v, best_at) {
  i = from; best_g = 0; best_v = 0; best_at = 0;
  do
  :: i <= end ->
     if
     :: !gone[i] && kind[i] == REC && (lgen[i] > best_g || (lgen[i] == best_g && i >= best_at)) ->
        best_g = lgen[i]; best_v = lval[i]; best_at = i
     :: else -> skip
     fi;
     i++
  :: else -> break
  od
}

proctype Owner(byte me) {
  byte from, end, g, cur, at, x, r, i, j, k, best_g, best_v, best_at;  /* cur: the last message this owner applied (or restored) */
  bit seen;
  /* claim (state::load), once the partition is assigned: the pointer
   * first (starts), then the marker (append_markers) and the read up to it
   * (read_range); the marker and the read are one step, as
   * min.compaction.lag.ms makes them (see the header) */
  atomic { turn == me -> from = pointer }
  atomic {
#ifdef NO_COMPACTION_LAG
    d_step { append(MARK, 0, 0, MARKER_KEY, end); printf("o%d: marker at %d, reading from %d\n", me, end, from) }
  }
  atomic {
    compaction(from);
    d_step {
#else
    compaction(from);
    d_step {
      append(MARK, 0, 0, MARKER_KEY, end); printf("o%d: marker at %d, reading from %d\n", me, end, from);
#endif
      scan(from, end, best_g, best_v, best_at);
#ifdef BROKEN_COUNTED_GEN
      /* wave 1: one per earlier marker read, at least every generation read */
      i = from; g = 0;
      do
      :: i < end ->
         if
         :: !gone[i] && kind[i] == MARK -> g++
         :: !gone[i] && kind[i] == REC && lgen[i] > g -> g = lgen[i]
         :: else -> skip
         fi;
         i++
      :: else -> break
      od;
      g++;
#else
      g = (best_g > end -> best_g : end) + 1;
#endif
      cur = best_v;
      if
      :: best_g > 0 -> printf("o%d: claims with generation %d, restores committed %d (record at %d)\n", me, g, cur, best_at)
      :: else -> printf("o%d: claims with generation %d, nothing saved\n", me, g)
      fi;
      CHECK("VIOLATION (k2) a claim's generation is not above an earlier claim's\n", g > max_gen);
      max_gen = g;
      claimed[me] = 1;
      from = 0; end = 0; best_g = 0; best_v = 0; best_at = 0;
      forget()
    }
  }
  do
  :: atomic {
       /* apply the next message: only while the owner (self-fence) */
       r < R && turn == me ->
       CHECK("VIOLATION (k1) a message applied below the last one applied\n", cur + 1 >= last_applied);
       cur++; last_applied = cur; r++;
       printf("o%d: applies %d\n", me, cur)
     }
     /* its state record (may land late, after a hand-over) */
     d_step { append(REC, g, cur, REC_KEY(g), at); printf("o%d: record (gen %d, committed %d) at %d\n", me, g, cur, at) }
     if
#ifdef SPARSE_CHECKPOINTS
     :: r < R -> skip   /* no checkpoint this round */
#endif
#ifdef BROKEN_POINTER
     :: d_step { pointer = at; printf("o%d: pointer -> %d\n", me, at); at = 0 }
#else
     :: from = pointer;
        /* state::advance: the pointer (starts, above), then the check
         * marker and the read up to it (one step, as the claim's), then the
         * commit */
        atomic {
#ifdef NO_COMPACTION_LAG
          d_step { append(CHECKM, 0, 0, MARKER_KEY, x) }
        }
        atomic {
          compaction(from);
          d_step {
#else
          compaction(from);
          d_step {
            append(CHECKM, 0, 0, MARKER_KEY, x);
#endif
            printf("o%d: check marker at %d, reading from %d\n", me, x, from);
            i = from; seen = 0;
            do
            :: i <= x ->
               if
               :: !gone[i] && kind[i] == REC && lgen[i] > g -> seen = 1
               :: else -> skip
               fi;
               i++
            :: else -> break
            od;
            from = 0; x = 0;
            forget()
          }
        }
        if
        :: seen -> printf("o%d: a newer owner wrote; partition lost\n", me); break
        :: else -> d_step { pointer = at; printf("o%d: pointer -> %d\n", me, at); at = 0 }
        fi
#endif
     fi
  :: r == R || turn != me -> break
  od
}

/* The coordinator: the next owner, once the current one claimed. */
active proctype Coordinator() {
  do
  :: atomic { turn < NO - 1 && claimed[turn] -> turn++; printf("coordinator: partition to o%d\n", turn) }
  :: turn == NO - 1 -> break
  od
}

init {
  byte k = 0;
  atomic {
    do
    :: k < NO -> run Owner(k); k++
    :: else -> break
    od
  }
}
