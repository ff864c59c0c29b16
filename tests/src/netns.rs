//! Network-namespace helpers.
