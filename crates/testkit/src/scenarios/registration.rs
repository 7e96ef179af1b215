//! What a subscription refuses at build or registration: C8 keys the types
//! cannot yield, C9 capability gating, C10 one key per category.

use keyorder_core::{Error, KeySource, MessageType, Resolved, Strategy};

use super::ctx::{ensure, err, Ctx, Outcome};

/// C8: ordering by a key the message types cannot yield fails at build.
pub(super) async fn c8(ctx: &Ctx<'_>) -> Outcome {
    let client = ctx.client().await?;
    let cat = ctx.category("orders");
    let bad = client
        .subscribe(&cat, "g")
        .ordered_by(KeySource::field("customer_id"))
        .message_type(MessageType::new("OrderPlaced").with_fields(["order_id", "customer_id"]))
        .message_type(MessageType::new("RefundIssued").with_fields(["order_id"]))
        .build()
        .await;
    match bad {
        Err(Error::Registration(msg)) if msg.contains("RefundIssued") => {}
        other => {
            return Err(format!(
                "expected a registration error naming RefundIssued, got {other:?}"
            ))
        }
    }
    let ok = client
        .subscribe(&cat, "g")
        .ordered_by(KeySource::field("customer_id").or_correlation_id())
        .message_type(MessageType::new("RefundIssued").with_fields(["order_id"]))
        .build()
        .await
        .map_err(|e| format!("a fallback step makes the key yieldable: {e}"))?;
    drop(ok);
    Ok(())
}

/// C9: `Auto` without cross-instance affinity fails naming the fix.
pub(super) async fn c9(ctx: &Ctx<'_>) -> Outcome {
    let client = ctx.client().await?;
    let cat = ctx.category("orders");
    let caps = client.capabilities();
    let sub = client
        .subscribe(&cat, "auto")
        .ordered_by(KeySource::routing_key())
        .build()
        .await;
    match (caps.cross_instance_affinity, sub) {
        (true, Ok(s)) => ensure(s.resolved() == Some(Resolved::TransportNative), || {
            "Auto must resolve natively".into()
        })?,
        (false, Err(Error::Unsupported { fix, .. })) => ensure(fix.contains("LocalPartitioned"), || fix)?,
        (_, other) => {
            return Err(format!(
                "Auto with affinity={} gave {other:?}",
                caps.cross_instance_affinity
            ))
        }
    }
    let local = client
        .subscribe(&cat, "local")
        .ordered_by(KeySource::routing_key())
        .strategy(Strategy::LocalPartitioned)
        .build()
        .await
        .map_err(err)?;
    ensure(local.resolved() == Some(Resolved::LocalPartitioned), || {
        "LocalPartitioned must be honoured".into()
    })?;
    if let Some(plain) = ctx.h.client_without_affinity().await {
        let plain = plain.map_err(err)?;
        match plain
            .subscribe(&cat, "plain")
            .ordered_by(KeySource::routing_key())
            .build()
            .await
        {
            Err(Error::Unsupported { capability, fix, .. })
                if capability == "cross_instance_affinity" && fix.contains("LocalPartitioned") => {}
            other => return Err(format!("Auto without affinity must fail naming the fix, got {other:?}")),
        }
    }
    // The resolver itself, with the affinity flag cleared.
    let without = keyorder_core::Capabilities {
        cross_instance_affinity: false,
        ..caps
    };
    match Strategy::Auto.resolve(ctx.h.name(), &without, "declare an affinity") {
        Err(Error::Unsupported { fix, .. }) if fix.contains("LocalPartitioned") => Ok(()),
        other => Err(format!("resolver without affinity gave {other:?}")),
    }
}

/// C10: two handlers on one category with different keys fail at registration.
pub(super) async fn c10(ctx: &Ctx<'_>) -> Outcome {
    let client = ctx.client().await?;
    let cat = ctx.category("orders");
    let first = client
        .subscribe(&cat, "billing")
        .ordered_by(KeySource::header("customer"))
        .build()
        .await
        .map_err(err)?;
    let same = client
        .subscribe(&cat, "shipping")
        .ordered_by(KeySource::header("customer"))
        .build()
        .await
        .map_err(|e| format!("the same key on another group must be accepted: {e}"))?;
    match client
        .subscribe(&cat, "audit")
        .ordered_by(KeySource::header("order"))
        .build()
        .await
    {
        Err(Error::Registration(msg)) if msg.contains("header(customer)") => {}
        other => return Err(format!("expected a registration error, got {other:?}")),
    }
    drop((first, same));
    Ok(())
}
