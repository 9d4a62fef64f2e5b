// The app shell of tether's phone helper: one screen over phone-ios's C ABI
// (include/tether_helper.h). Written here, never compiled here (no Swift toolchain on this
// repository's machines): docs/PHONE.md has the manual test plan for a Mac and an iPhone.
import SwiftUI

@main
struct TetherHelperApp: App {
    @StateObject private var helper = HelperModel()

    var body: some Scene {
        WindowGroup {
            ContentView(helper: helper)
        }
    }
}
