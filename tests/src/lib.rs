//! Shared helpers for the packet and namespace tests.
