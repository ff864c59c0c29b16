//! What the fleet needs of etcd, as a trait: the daemon uses the JSON gateway
//! ([`super::gateway`]), the unit tests an in-memory fake with a simulated lease clock.

use std::future::Future;

use tokio::sync::mpsc;

/// One key as etcd holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kv {
    pub key: String,
    pub value: Vec<u8>,
    pub mod_revision: i64,
}

/// The keys found and the store's revision when they were read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Range {
    pub kvs: Vec<Kv>,
    pub revision: i64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WatchEvent {
    Put(Kv),
    Delete { key: String, mod_revision: i64 },
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// No endpoint answered (or not in time): the fleet runs on what it last applied.
    #[error("etcd unreachable: {0}")]
    Unreachable(String),
    /// etcd answered but refused or returned what we cannot read.
    #[error("etcd error: {0}")]
    Refused(String),
}

/// Watch batches as they come; an `Err` ends the watch (the caller starts a new one).
pub type Watch = mpsc::Receiver<Result<Vec<WatchEvent>, StoreError>>;

pub trait Store: Send + Sync + 'static {
    /// Every key starting with `prefix` (an exact key is a prefix of itself only when no
    /// other key extends it: callers use distinct key shapes).
    fn list(&self, prefix: &str) -> impl Future<Output = Result<Range, StoreError>> + Send;
    /// Writes `value` if the key's mod revision is `mod_revision` (0: the key is absent),
    /// attached to `lease` (0: none). False when the comparison failed.
    fn put_if(
        &self,
        key: &str,
        value: Vec<u8>,
        mod_revision: i64,
        lease: i64,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;
    /// Writes `value` unconditionally, attached to `lease` (0: none).
    fn put(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: i64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// A new lease of `ttl_s` seconds; its id.
    fn grant(&self, ttl_s: i64) -> impl Future<Output = Result<i64, StoreError>> + Send;
    /// Renews a lease; false when it has expired (its keys are gone).
    fn keep_alive(&self, lease: i64) -> impl Future<Output = Result<bool, StoreError>> + Send;
    /// Changes under `prefix` after revision `after`.
    fn watch(
        &self,
        prefix: &str,
        after: i64,
    ) -> impl Future<Output = Result<Watch, StoreError>> + Send;
}

#[cfg(test)]
pub mod fake {
    //! An etcd in memory: revisions, compare-and-put, leases that expire on a simulated
    //! clock, watches, and a switch that makes it unreachable.
    use std::{
        collections::BTreeMap,
        sync::{
            atomic::{AtomicBool, Ordering},
            Arc, Mutex,
        },
    };

    use super::*;

    type WatchTx = mpsc::Sender<Result<Vec<WatchEvent>, StoreError>>;

    #[derive(Default)]
    struct Inner {
        kvs: BTreeMap<String, (Vec<u8>, i64, i64)>,
        revision: i64,
        /// lease id → expiry (simulated ms) and ttl
        leases: BTreeMap<i64, (u64, u64)>,
        next_lease: i64,
        now_ms: u64,
        down: bool,
        /// (prefix, sender, the watching client's link)
        watchers: Vec<(String, WatchTx, Arc<AtomicBool>)>,
    }

    /// One client's handle: clones share the store; [`FakeStore::client`] makes a handle
    /// with its own network link, which [`FakeStore::cut`] breaks (a partitioned host).
    #[derive(Clone, Default)]
    pub struct FakeStore(Arc<Mutex<Inner>>, Arc<AtomicBool>);

    impl FakeStore {
        pub fn client(&self) -> FakeStore {
            FakeStore(self.0.clone(), Arc::default())
        }

        pub fn cut(&self, cut: bool) {
            self.1.store(cut, Ordering::SeqCst);
        }

        pub fn set_down(&self, down: bool) {
            let mut i = self.0.lock().unwrap();
            i.down = down;
            if down {
                // A watch stream breaks with the connection.
                for (_, w, _) in i.watchers.drain(..) {
                    let _ = w.try_send(Err(StoreError::Unreachable("fake: down".into())));
                }
            }
        }

        /// Moves the simulated clock; leases past their TTL expire and drop their keys.
        pub fn advance(&self, ms: u64) {
            let mut i = self.0.lock().unwrap();
            i.now_ms += ms;
            let now = i.now_ms;
            let dead: Vec<i64> = i
                .leases
                .iter()
                .filter(|(_, (exp, _))| *exp <= now)
                .map(|(id, _)| *id)
                .collect();
            for id in dead {
                i.leases.remove(&id);
                let keys: Vec<String> = i
                    .kvs
                    .iter()
                    .filter(|(_, (_, _, l))| *l == id)
                    .map(|(k, _)| k.clone())
                    .collect();
                for k in keys {
                    i.kvs.remove(&k);
                    i.revision += 1;
                    let ev = WatchEvent::Delete {
                        key: k.clone(),
                        mod_revision: i.revision,
                    };
                    i.notify(&k, ev);
                }
            }
        }

        pub fn get(&self, key: &str) -> Option<Vec<u8>> {
            self.0.lock().unwrap().kvs.get(key).map(|v| v.0.clone())
        }

        fn check(&self) -> Result<std::sync::MutexGuard<'_, Inner>, StoreError> {
            let i = self.0.lock().unwrap();
            if i.down || self.1.load(Ordering::SeqCst) {
                return Err(StoreError::Unreachable("fake: down".into()));
            }
            Ok(i)
        }
    }

    impl Inner {
        fn notify(&mut self, key: &str, ev: WatchEvent) {
            self.watchers.retain(|(p, w, cut)| {
                if cut.load(Ordering::SeqCst) {
                    // The link is cut: the stream breaks.
                    let _ = w.try_send(Err(StoreError::Unreachable("fake: cut".into())));
                    return false;
                }
                !key.starts_with(p.as_str()) || w.try_send(Ok(vec![ev.clone()])).is_ok()
            });
        }

        fn write(&mut self, key: &str, value: Vec<u8>, lease: i64) {
            self.revision += 1;
            let rev = self.revision;
            self.kvs
                .insert(key.to_string(), (value.clone(), rev, lease));
            self.notify(
                key,
                WatchEvent::Put(Kv {
                    key: key.to_string(),
                    value,
                    mod_revision: rev,
                }),
            );
        }
    }

    impl Store for FakeStore {
        async fn list(&self, prefix: &str) -> Result<Range, StoreError> {
            let i = self.check()?;
            Ok(Range {
                kvs: i
                    .kvs
                    .range(prefix.to_string()..)
                    .take_while(|(k, _)| k.starts_with(prefix))
                    .map(|(k, (v, r, _))| Kv {
                        key: k.clone(),
                        value: v.clone(),
                        mod_revision: *r,
                    })
                    .collect(),
                revision: i.revision,
            })
        }

        async fn put_if(
            &self,
            key: &str,
            value: Vec<u8>,
            mod_revision: i64,
            lease: i64,
        ) -> Result<bool, StoreError> {
            let mut i = self.check()?;
            let now = i.kvs.get(key).map_or(0, |v| v.1);
            if now != mod_revision {
                return Ok(false);
            }
            if lease != 0 && !i.leases.contains_key(&lease) {
                return Err(StoreError::Refused("requested lease not found".into()));
            }
            i.write(key, value, lease);
            Ok(true)
        }

        async fn put(&self, key: &str, value: Vec<u8>, lease: i64) -> Result<(), StoreError> {
            let mut i = self.check()?;
            if lease != 0 && !i.leases.contains_key(&lease) {
                return Err(StoreError::Refused("requested lease not found".into()));
            }
            i.write(key, value, lease);
            Ok(())
        }

        async fn grant(&self, ttl_s: i64) -> Result<i64, StoreError> {
            let mut i = self.check()?;
            i.next_lease += 1;
            let (id, ttl) = (i.next_lease, ttl_s as u64 * 1000);
            let exp = i.now_ms + ttl;
            i.leases.insert(id, (exp, ttl));
            Ok(id)
        }

        async fn keep_alive(&self, lease: i64) -> Result<bool, StoreError> {
            let mut i = self.check()?;
            let now = i.now_ms;
            Ok(match i.leases.get_mut(&lease) {
                Some((exp, ttl)) => {
                    *exp = now + *ttl;
                    true
                }
                None => false,
            })
        }

        async fn watch(&self, prefix: &str, after: i64) -> Result<Watch, StoreError> {
            let mut i = self.check()?;
            let (tx, rx) = mpsc::channel(1024);
            // Only "now onwards" is kept in memory: a watch from the past replays the keys
            // changed since, as etcd would from its history.
            let missed: Vec<WatchEvent> = i
                .kvs
                .iter()
                .filter(|(k, (_, r, _))| k.starts_with(prefix) && *r > after)
                .map(|(k, (v, r, _))| {
                    WatchEvent::Put(Kv {
                        key: k.clone(),
                        value: v.clone(),
                        mod_revision: *r,
                    })
                })
                .collect();
            if !missed.is_empty() {
                let _ = tx.try_send(Ok(missed));
            }
            i.watchers.push((prefix.to_string(), tx, self.1.clone()));
            Ok(rx)
        }
    }
}
