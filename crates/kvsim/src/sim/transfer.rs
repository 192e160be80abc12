//! Disaggregated serving: the hand-over of a prefilled request to a decode engine and its KV
//! transfer, alone on a link or sharing the prefill engine's link with others.

use super::*;

/// One prefill engine's link when transfers share it: the transfers on it, each with the bits
/// it has left, all served at an equal share of the bandwidth since `last`.
#[derive(Debug, Default)]
pub(super) struct Link {
    pub(super) flows: Vec<(usize, f64)>,
    pub(super) last: u64,
    pub(super) gen: u32,
}

impl Run<'_> {
    /// Disaggregated: the prefill engine has let go of the request; a decode engine is routed
    /// with the decode role's weight, and the KV it lacks is sent over.
    pub(super) fn hand_over(&mut self, r: usize, blocks: Vec<BlockHash>) {
        self.release_router(r, Pool::Prefill);
        let Some(decode) = self.fleet.decode_routers.as_mut() else {
            return;
        };
        let session = self.reqs[r].session;
        let (router, d, _) = match decode.route(r, &blocks, self.now, session) {
            Ok(x) => x,
            Err(_) => {
                self.router_errors += 1;
                return;
            }
        };
        self.share_load(Pool::Decode, router);
        let bs = self.cfg.block_size.get();
        let decode_hits = self.fleet.engines[d].cache().match_len(&blocks);
        let req = &mut self.reqs[r];
        req.decode_router = router;
        req.rec.decode_engine = Some(d);
        req.rec.decode_hits = decode_hits;
        req.in_transit = blocks;
        let input = req.rec.input;
        let sent_tokens = input - (decode_hits * bs).min(input);
        let bits = sent_tokens as f64 * self.cfg.kv_bytes_per_token as f64 * 8.0;
        if self.cfg.pd_link == PdLink::Shared && bits > 0.0 {
            let e = req.rec.engine;
            req.rec.transfer_us = self.now;
            self.advance_link(e);
            self.links[e].flows.push((r, bits));
            self.schedule_link(e);
            return;
        }
        let transfer = (bits / (self.cfg.pd_transfer_gbps * 1e3)).round() as u64
            + self.cfg.pd_transfer_latency_us;
        req.rec.transfer_us = transfer;
        self.push(self.now.saturating_add(transfer), Kind::TransferDone(r));
    }

    /// Shared links: serves link `e`'s transfers their equal shares of the time since its
    /// last change.
    pub(super) fn advance_link(&mut self, e: usize) {
        let link = &mut self.links[e];
        let k = link.flows.len();
        if k > 0 {
            let share = (self.now - link.last) as f64 * self.cfg.pd_transfer_gbps * 1e3 / k as f64;
            for f in &mut link.flows {
                f.1 -= share;
            }
        }
        link.last = self.now;
    }

    /// Shared links: queues the completion of link `e`'s transfer with the fewest bits left,
    /// at the current shares (replacing any queued one).
    pub(super) fn schedule_link(&mut self, e: usize) {
        let link = &mut self.links[e];
        link.gen = link.gen.wrapping_add(1);
        let Some(left) = link.flows.iter().map(|f| f.1).reduce(f64::min) else {
            return;
        };
        let rate = self.cfg.pd_transfer_gbps * 1e3 / link.flows.len() as f64;
        // Whole microseconds, rounded as a lone transfer's duration is.
        let dt = (left.max(0.0) / rate).round() as u64;
        let gen = link.gen;
        self.push(self.now.saturating_add(dt), Kind::LinkDone(e, gen));
    }

    /// Shared links: the transfers of link `e` that are through start their fixed latency;
    /// the rest share the link anew.
    pub(super) fn link_done(&mut self, e: usize, gen: u32) {
        if gen != self.links[e].gen {
            return;
        }
        self.advance_link(e);
        // Transfers within half a microsecond of their end (at their share) are through.
        let k = self.links[e].flows.len().max(1);
        let half_us = 0.5 * self.cfg.pd_transfer_gbps * 1e3 / k as f64;
        let mut done = Vec::new();
        self.links[e].flows.retain(|&(r, left)| {
            if left <= half_us {
                done.push(r);
                false
            } else {
                true
            }
        });
        for r in done {
            let arrive = self.now.saturating_add(self.cfg.pd_transfer_latency_us);
            let rec = &mut self.reqs[r].rec;
            rec.transfer_us = arrive - rec.transfer_us;
            self.push(arrive, Kind::TransferDone(r));
        }
        self.schedule_link(e);
    }

    pub(super) fn transfer_done(&mut self, r: usize) {
        let req = &mut self.reqs[r];
        let Some(d) = req.rec.decode_engine else {
            return;
        };
        let blocks = std::mem::take(&mut req.in_transit);
        let er = EngineRequest::new(r as u64, blocks, req.rec.input, req.rec.output);
        self.interrupt(d);
        if !self.submit(d, er) {
            self.reqs[r].rec.rejected = true;
            self.release_router(r, Pool::Decode);
            self.request_done(r);
        }
    }
}
