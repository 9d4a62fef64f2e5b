// The helper as the screen sees it: starts and stops phone-ios's helper through its C ABI,
// polls its JSON status twice a second, and keeps the phone awake while it is plugged in.
import Foundation
import os
import TetherHelperFFI
import UIKit

/// What `tether_helper_status` reports (engine_core::helper::runner::Status).
struct HelperStatus: Decodable {
    var state: String
    var address: String?
    var pairing_code: String?
    var host: String?
    var sessions: UInt64
    var mem_budget: UInt64
    var helper: [String: UInt64]
    var link_sent_bytes: UInt64
    var link_received_bytes: UInt64
    var error: String?
}

@MainActor
final class HelperModel: ObservableObject {
    /// A host that accepts helpers (`tether serve --accept-helpers`), or empty to listen.
    @Published var hostURL = ""
    /// The code the host shows, the first time.
    @Published var pairingCode = ""
    /// The host's model: a preset (`tiny`, `qwen35-0.8b`) or a checkpoint in the app's files.
    @Published var model = "tiny"
    /// Bytes offered to the host.
    @Published var budget: Double
    @Published private(set) var status: HelperStatus?
    @Published private(set) var startError: String?
    @Published private(set) var thermal = ProcessInfo.processInfo.thermalState

    /// What this app may still allocate: the slider's top.
    let available = Double(os_proc_available_memory())

    private var handle: OpaquePointer?
    private var timer: Timer?

    init() {
        budget = Double(os_proc_available_memory()) / 2
        UIDevice.current.isBatteryMonitoringEnabled = true
        NotificationCenter.default.addObserver(
            forName: UIDevice.batteryStateDidChangeNotification, object: nil, queue: .main
        ) { [weak self] _ in Task { @MainActor in self?.keepAwake() } }
        NotificationCenter.default.addObserver(
            forName: ProcessInfo.thermalStateDidChangeNotification, object: nil, queue: .main
        ) { [weak self] _ in
            Task { @MainActor in self?.thermal = ProcessInfo.processInfo.thermalState }
        }
    }

    var running: Bool { handle != nil }

    func start() {
        guard handle == nil else { return }
        var config: [String: Any] = ["model": model, "mem-budget": String(UInt64(budget))]
        if hostURL.isEmpty {
            config["listen"] = "0.0.0.0:7341"
        } else {
            config["join"] = hostURL
            if !pairingCode.isEmpty { config["pair"] = pairingCode }
        }
        let json = String(data: try! JSONSerialization.data(withJSONObject: config), encoding: .utf8)!
        var error: UnsafeMutablePointer<CChar>?
        handle = tether_helper_start(json, &error)
        if handle == nil {
            startError = error.map { String(cString: $0) } ?? "the helper did not start"
            tether_string_free(error)
            return
        }
        startError = nil
        timer = Timer.scheduledTimer(withTimeInterval: 0.5, repeats: true) { [weak self] _ in
            Task { @MainActor in self?.poll() }
        }
        keepAwake()
    }

    func stop() {
        timer?.invalidate()
        timer = nil
        if let h = handle {
            handle = nil
            // Lets a host being served go within a fraction of a second.
            tether_helper_stop(h)
        }
        keepAwake()
    }

    private func poll() {
        guard let h = handle, let raw = tether_helper_status(h) else { return }
        defer { tether_string_free(raw) }
        status = try? JSONDecoder().decode(HelperStatus.self, from: Data(String(cString: raw).utf8))
    }

    /// Plugged in and helping: the screen stays on, so the phone does not sleep under a host.
    private func keepAwake() {
        let state = UIDevice.current.batteryState
        UIApplication.shared.isIdleTimerDisabled =
            running && (state == .charging || state == .full)
    }
}
