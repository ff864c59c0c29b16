//! `sluice vip` and `sluice backend`: the table's changes, one API request each.

use std::{collections::BTreeMap, net::IpAddr};

use anyhow::Result;
use serde_json::json;

use super::{
    args::{backend_spec, BackendCommand, VipCommand},
    cell, host_port, print_backends, print_vips, timestamp, Output,
};
use crate::{
    admin::{DrainRequest, NewVip, WeightChange},
    client::{path_segment, Client},
    state::VipSpec,
};

pub(super) fn vip(cmd: &VipCommand, client: &Client, out: &mut Output) -> Result<()> {
    match cmd {
        VipCommand::List => out.show(&client.call("GET", "/v1/vips", None)?, print_vips),
        VipCommand::Add(a) => {
            let mut spec: VipSpec = serde_json::from_value(json!({
                "name": a.name, "address": a.address, "port": a.port, "protocol": a.protocol,
                "hash": a.hash,
            }))
            .expect("the required fields are given");
            spec.affinity_secs = a.affinity_window.unwrap_or(spec.affinity_secs);
            spec.priority = a.priority.unwrap_or(spec.priority);
            spec.ring_size = a.ring_size.unwrap_or(spec.ring_size);
            spec.flow_state = a.flow_state;
            spec.quic = a.quic;
            spec.quic_server_id_len = a.quic_server_id_len.unwrap_or(spec.quic_server_id_len);
            spec.quic_config_rotation = a.quic_config_rotation.unwrap_or(spec.quic_config_rotation);
            let body = serde_json::to_value(NewVip {
                vip: spec,
                backends: a.backends.clone(),
            })?;
            let v = client.call("POST", "/v1/vips", Some(&body))?;
            out.show(&v, |out, v| {
                let vip = &v["vip"];
                writeln!(
                    out,
                    "added VIP {}: {} {}, {} backends",
                    cell(&vip["name"]),
                    cell(&vip["protocol"]),
                    host_port(vip),
                    cell(&vip["backend_count"])
                )?;
                Ok(())
            })
        }
        VipCommand::Remove { name } => {
            let v = client.call("DELETE", &format!("/v1/vips/{}", path_segment(name)), None)?;
            out.show(&v, |out, _| Ok(writeln!(out, "removed VIP {name}")?))
        }
    }
}

pub(super) fn backend(cmd: &BackendCommand, client: &Client, out: &mut Output) -> Result<()> {
    let base = |vip: &str| format!("/v1/vips/{}/backends", path_segment(vip));
    let one = |vip: &str, address: &IpAddr| {
        format!("{}/{}", base(vip), path_segment(&address.to_string()))
    };
    match cmd {
        BackendCommand::List { vip } => {
            out.show(&client.call("GET", &base(vip), None)?, print_backends)
        }
        BackendCommand::Add {
            vip,
            address,
            weight,
            labels,
            max_sessions,
            quic_server_id,
        } => {
            let mut spec = backend_spec(*address);
            spec.weight = weight.unwrap_or(spec.weight);
            spec.labels = labels.iter().cloned().collect::<BTreeMap<_, _>>();
            spec.max_sessions = max_sessions.unwrap_or(spec.max_sessions);
            spec.quic_server_id = quic_server_id.clone();
            let v = client.call("POST", &base(vip), Some(&serde_json::to_value(spec)?))?;
            out.show(&v, |out, v| {
                Ok(writeln!(
                    out,
                    "added backend {address} to {vip} (id {}, weight {})",
                    cell(&v["id"]),
                    cell(&v["weight"])
                )?)
            })
        }
        BackendCommand::Remove { vip, address } => {
            let v = client.call("DELETE", &one(vip, address), None)?;
            out.show(&v, |out, _| {
                Ok(writeln!(out, "removed backend {address} from {vip}")?)
            })
        }
        BackendCommand::SetWeight {
            vip,
            address,
            weight,
        } => {
            let body = serde_json::to_value(WeightChange { weight: *weight })?;
            let v = client.call("PUT", &format!("{}/weight", one(vip, address)), Some(&body))?;
            out.show(&v, |out, v| {
                Ok(writeln!(
                    out,
                    "backend {address} of {vip}: weight {}",
                    cell(&v["weight"])
                )?)
            })
        }
        BackendCommand::Drain {
            vip,
            address,
            deadline,
        } => {
            let body = serde_json::to_value(DrainRequest {
                deadline: deadline.clone(),
            })?;
            let v = client.call("POST", &format!("{}/drain", one(vip, address)), Some(&body))?;
            out.show(&v, |out, v| {
                let until = match v["drain_deadline_ms"].as_u64() {
                    Some(ms) => format!("when its flows end, or at {}", timestamp(ms)),
                    None => "when its flows end".into(),
                };
                Ok(writeln!(
                    out,
                    "draining backend {address} of {vip}: no new flows; removed {until}"
                )?)
            })
        }
        BackendCommand::Undrain { vip, address } => {
            let v = client.call("POST", &format!("{}/undrain", one(vip, address)), None)?;
            out.show(&v, |out, _| {
                Ok(writeln!(
                    out,
                    "backend {address} of {vip} takes new flows again"
                )?)
            })
        }
    }
}
