//! What a source owns, shared with its settles, its committer, its checks
//! and its heartbeat: the owned partitions ([`Part`]), the shared state
//! ([`Shared`]), and the work that keeps ownership honest: the state rounds
//! (`rounds`), the pointer checks (`checkpoint`), the heartbeat's
//! self-fence (`heartbeat`) and a static member's incarnation
//! (`incarnation`). Both `source` and `settle` use it; it uses neither.

pub(crate) mod checkpoint;
mod heartbeat;
mod incarnation;
mod part;
mod rounds;
mod shared;

pub(crate) use self::incarnation::check_static_member;
pub(crate) use self::part::{HeldHead, Part};
pub(crate) use self::shared::{Ctx, Ev, Member, Shared};
