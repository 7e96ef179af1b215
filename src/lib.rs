//! keyorder
