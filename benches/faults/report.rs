//! The report: the Markdown tables of the fault cases and of the client disconnects.

use std::time::Duration;

use crate::cases::ok_text;
use crate::disconnect::DisconnectRow;
use crate::env::{pct, Row};
use crate::Knobs;

fn pair(p: (u64, u64)) -> String {
    format!("{} / {}", p.0, p.1)
}

pub(crate) fn report(k: &Knobs, rows: &[Row], dis: &[DisconnectRow], total: Duration) {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!();
    println!(
        "## pdgate fault bench ({} requests per case, 2 ms apart; {cores} cores; router, engines and client in one process{})",
        k.n,
        if k.quick { "; QUICK smoke run" } else { "" }
    );
    println!();
    println!("| fault | setup | client-visible answers | time to answer p50 / p99 / max ms | slowest error answer ms | router saw it after | faulty engine got | decode got | held right after (P / D) | all released after ms (held at 2 s, P / D) | prefill aborted / disconnected | decode aborted / disconnected | target | verdict |");
    println!("|---|---|---|---|---:|---|---:|---:|---|---|---|---|---|---|");
    for r in rows {
        let mix: Vec<String> = r.mix.iter().map(|(k, v)| format!("{v}× {k}")).collect();
        println!(
            "| {} | {} | {} | {:.1} / {:.1} / {:.1} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r.fault,
            r.setup,
            mix.join(", "),
            r.pct(0.5),
            r.pct(0.99),
            r.max(),
            if r.err_ms.is_empty() { "—".to_string() } else { format!("{:.1}", r.err_max()) },
            r.detect,
            r.faulty_saw,
            r.decode_saw,
            pair(r.held_after),
            match r.released {
                Some(_) if r.held_after == (0, 0) => "—".to_string(),
                Some(d) => format!("{:.1}", d.as_secs_f64() * 1000.0),
                None => format!("**not within 2 s** ({})", pair(r.held_1s)),
            },
            pair(r.p_abort),
            pair(r.d_abort),
            r.target,
            r.verdict
        );
    }
    println!();
    println!("| client disconnect | n | engines holding it at the drop (min–max) | both legs released after p50 / p99 / max ms | not released within 2 s | prefill aborted / disconnected | decode aborted / disconnected | target ≤ 100 ms |");
    println!("|---|---:|---|---|---:|---|---|---|");
    for d in dis {
        let lo = d.held_at_drop.iter().min().copied().unwrap_or(0);
        let hi = d.held_at_drop.iter().max().copied().unwrap_or(0);
        let max = d.cancel_ms.last().copied().unwrap_or(f64::NAN);
        println!(
            "| {} | {} | {lo}–{hi} | {:.1} / {:.1} / {:.1} | {} | {} | {} | {} |",
            d.case,
            d.n,
            pct(&d.cancel_ms, 0.5),
            pct(&d.cancel_ms, 0.99),
            max,
            d.not_cancelled,
            pair(d.p_abort),
            pair(d.d_abort),
            ok_text(d.not_cancelled == 0 && max <= 100.0)
        );
    }
    for d in dis {
        for e in &d.early {
            println!("- note ({}): {e}", d.case);
        }
    }
    println!();
    println!("(total {:.1} s)", total.as_secs_f64());
}
