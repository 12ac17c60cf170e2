//! Connection budgets by class. Local loaders, authenticated peers and HTTP clients each
//! have their own budget, so a flood on one port never refuses another class; connections
//! that have not completed the peer handshake, and HTTP connections, are also bounded per
//! source address, so one address cannot take a whole class's budget.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

/// The connection classes, each with its own budget and refusal counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Class {
    /// Loaders on the Unix socket (this user only).
    Local = 0,
    /// Peers that completed the authenticated handshake.
    Peer = 1,
    /// Peer-port connections before and during the handshake.
    Handshake = 2,
    /// `/stats`, `/metrics`, `/health`, `/ready`.
    Http = 3,
}

impl Class {
    /// The class's name, as `/stats` `connections_refused` keys it (in index order: local,
    /// peer, handshake, http).
    pub(crate) fn name(self) -> &'static str {
        match self {
            Class::Local => "local",
            Class::Peer => "peer",
            Class::Handshake => "handshake",
            Class::Http => "http",
        }
    }
}

#[derive(Default)]
struct Held {
    total: usize,
    by_addr: HashMap<IpAddr, usize>,
}

/// A budget of `max` connections at once, at most `per_addr` of them from one address.
pub(crate) struct Budget {
    class: Class,
    max: usize,
    per_addr: usize,
    held: Arc<Mutex<Held>>,
}

/// One connection's place in a budget, given back when dropped.
pub(crate) struct Permit {
    held: Arc<Mutex<Held>>,
    addr: Option<IpAddr>,
}

/// Why a connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The class is full.
    Class,
    /// This address holds its share of the class.
    Address,
}

impl Budget {
    /// A budget of `max` at once (at least 1), at most `per_addr` from one address (at least
    /// 1; `usize::MAX` for no per-address bound).
    pub(crate) fn new(class: Class, max: usize, per_addr: usize) -> Budget {
        Budget {
            class,
            max: max.max(1),
            per_addr: per_addr.max(1),
            held: Arc::default(),
        }
    }

    pub(crate) fn class(&self) -> Class {
        self.class
    }

    pub(crate) fn max(&self) -> usize {
        self.max
    }

    pub(crate) fn per_addr(&self) -> usize {
        self.per_addr
    }

    /// A place for a connection from `addr` (`None`: a Unix-socket connection, bounded by the
    /// class alone), or why there is none.
    pub(crate) fn try_take(&self, addr: Option<IpAddr>) -> Result<Permit, Refused> {
        let mut h = self.held.lock().expect("budget lock");
        if h.total >= self.max {
            return Err(Refused::Class);
        }
        if let Some(a) = addr {
            let n = h.by_addr.entry(a).or_insert(0);
            if *n >= self.per_addr {
                return Err(Refused::Address);
            }
            *n += 1;
        }
        h.total += 1;
        Ok(Permit {
            held: self.held.clone(),
            addr,
        })
    }

    /// Connections held now.
    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        self.held.lock().expect("budget lock").total
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut h = self.held.lock().expect("budget lock");
        h.total -= 1;
        if let Some(a) = self.addr {
            if let Some(n) = h.by_addr.get_mut(&a) {
                *n -= 1;
                if *n == 0 {
                    h.by_addr.remove(&a);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_bounds_its_class_and_each_address_and_gives_back_on_drop() {
        let b = Budget::new(Class::Handshake, 3, 2);
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let c: IpAddr = "10.0.0.2".parse().unwrap();
        let p1 = b.try_take(Some(a)).unwrap();
        let _p2 = b.try_take(Some(a)).unwrap();
        assert_eq!(b.try_take(Some(a)).err(), Some(Refused::Address));
        let _p3 = b.try_take(Some(c)).unwrap();
        assert_eq!(b.try_take(Some(c)).err(), Some(Refused::Class));
        assert_eq!(b.try_take(None).err(), Some(Refused::Class));
        drop(p1);
        assert_eq!(b.held(), 2);
        let _p4 = b.try_take(Some(a)).unwrap();
        assert_eq!(b.held(), 3);
    }

    #[test]
    fn unix_connections_count_against_the_class_only() {
        let b = Budget::new(Class::Local, 2, 1);
        let _a = b.try_take(None).unwrap();
        let _b = b.try_take(None).unwrap();
        assert_eq!(b.try_take(None).err(), Some(Refused::Class));
    }
}
