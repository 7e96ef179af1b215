//! The names of the broker's things: a partition's scope is `category/pN`.

use std::sync::Arc;

pub(super) fn scope_name(category: &str, part: u32) -> Arc<str> {
    Arc::from(format!("{category}/p{part}"))
}

pub(super) fn parse_scope(scope: &str) -> Option<u32> {
    scope.rsplit_once("/p").and_then(|(_, n)| n.parse().ok())
}
