//! Weighted Maglev.
